// The parameter registry: every parameter's global name and shape, which slice this rank
// holds, and whether it is a dense or an expert parameter. Values and gradients live in one
// flat buffer per kind (dense, expert) so that optimizers and gradient buckets see contiguous
// memory; initialization is a pure function of (seed, name, global element index).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"

namespace moecore {

enum class ParamKind : uint8_t { Dense, Expert };
enum class ParamInit : uint8_t { Normal, Ones, Zeros };

// The slice of the global tensor this rank holds: [offset, offset + length) along `dim`;
// dim = -1 means the whole tensor.
struct ParamSlice {
  int dim = -1;
  int64_t offset = 0;
  int64_t length = 0;
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> global_shape;
  ParamInit init = ParamInit::Normal;
  double init_std = 0.02;
  ParamKind kind = ParamKind::Dense;
  bool weight_decay = true;  // Megatron: no decay on norms and biases
  ParamSlice slice{};
};

struct Param {
  ParamSpec spec;
  DType dtype = DType::F32;
  int64_t offset = 0;  // element offset into its kind's flat buffers
  DevPtr<void> data = nullptr;
  DevPtr<void> grad = nullptr;
  // --bf16 compute copy, refreshed from `data` each step, in one of two formats: bf16 (data16,
  // what the native bf16 GEMMs read) or the same bf16 values widened to f32 (data16w, what the
  // widened-bf16 GEMM path reads). The has_ flags are set by allocate() in both passes (the
  // pointers are null while planning).
  DevPtr<bf16> data16 = nullptr;
  DevPtr<float> data16w = nullptr;
  bool has_data16 = false;
  bool has_data16w = false;
  bool has_bf16_copy() const { return has_data16 || has_data16w; }

  const std::string& name() const { return spec.name; }
  std::vector<int64_t> local_shape() const;
  int64_t local_numel() const;
  int64_t global_numel() const;

  template <typename T>
  DevPtr<T> data_as() const {
    MOE_CHECK(DTypeOf<T>::value == dtype, "[params] '{}' is {} not {}", spec.name,
              dtype_name(dtype), dtype_name(DTypeOf<T>::value));
    return dev_ptr_cast<T>(data);
  }
  template <typename T>
  DevPtr<T> grad_as() const {
    (void)data_as<T>();
    return dev_ptr_cast<T>(grad);
  }
};

class ParamRegistry {
 public:
  explicit ParamRegistry(DType dtype = DType::F32) : dtype_(dtype) {}

  // Registers a parameter; the reference stays valid for the registry's lifetime.
  Param& add(ParamSpec spec);

  // Mixed precision (--bf16): also keep bf16 compute copies of the values. Call before
  // allocate(); refresh_bf16() after every change of the values (init, optimizer step).
  // widened: keep the bf16 values widened to f32 (data16w) instead of bf16 (data16): what the
  // widened-bf16 GEMM path (ops/gemm_bf16.h) reads instead of widening every weight at every
  // GEMM; it never reads bf16 weights, so no bf16 copy is kept beside it.
  void enable_bf16_copies(bool widened = false) {
    bf16_copies_ = true;
    bf16_widened_ = widened;
  }
  bool has_bf16_copies() const { return bf16_copies_; }
  bool bf16_widened() const { return bf16_copies_ && bf16_widened_; }
  // The copies from the values, with the cast ops on the arena's context.
  void refresh_bf16();
  // The next refresh_bf16() skips `kind`, then converts as usual: for an optimizer that rewrote
  // every bf16 copy of `kind` in the pass that updated the values (ops::adamw_step's p16), and
  // for values that arrive later than the step (the distributed optimizer's deferred gathers,
  // --overlap-param-gather), which whoever completes them converts per range with
  // refresh_bf16(kind, offset, count). Valid only when nothing else changes the values of
  // `kind` before that refresh (the trainer refreshes right after the optimizer step).
  void mark_bf16_current(ParamKind kind) { bf16_current_[static_cast<int>(kind)] = true; }
  // The copies of elements [offset, offset + count) of the kind's flat buffer (the same
  // conversion as refresh_bf16(), element by element).
  void refresh_bf16(ParamKind kind, int64_t offset, int64_t count);

  // Two passes like every arena user: flat value and gradient buffers per kind.
  void allocate(Arena& arena);
  // Writes every value on the host, before step 0 (a pure function of the seed, the name and
  // the global index).
  void init(uint64_t seed);
  // Clears the gradients (ops::zero on the arena's context: part of the step).
  void zero_grads();
  // Digest of the values of `kind` held here: a sum over elements of a hash of (name, global
  // index, value bits), so the digests of ranks holding disjoint slices add up (mod 2^64) to the
  // digest of the whole tensor, whatever the layout. Two models with bitwise equal values have
  // equal digests; a changed value changes it (up to hash collisions).
  uint64_t digest(ParamKind kind) const;

  Param& get(const std::string& name);
  const Param* find(const std::string& name) const;
  std::deque<Param>& params() { return params_; }
  const std::deque<Param>& params() const { return params_; }

  DType dtype() const { return dtype_; }
  // The execution context of the arena the values live in (from allocate()).
  const Exec& exec() const { return *ex_; }
  int64_t numel(ParamKind kind) const { return numel_[static_cast<int>(kind)]; }
  DevPtr<void> flat_data(ParamKind kind) const { return data_[static_cast<int>(kind)]; }
  DevPtr<void> flat_grad(ParamKind kind) const { return grad_[static_cast<int>(kind)]; }

 private:
  DType dtype_;
  const Exec* ex_ = &cpu_exec();
  std::deque<Param> params_;
  // name -> position in params_: registering a model of thousands of layers stays linear.
  std::unordered_map<std::string, size_t> index_;
  int64_t numel_[2] = {0, 0};
  DevPtr<void> data_[2] = {nullptr, nullptr};
  DevPtr<void> grad_[2] = {nullptr, nullptr};
  DevPtr<bf16> data16_[2] = {nullptr, nullptr};
  DevPtr<float> data16w_[2] = {nullptr, nullptr};
  bool bf16_copies_ = false;
  bool bf16_widened_ = false;
  bool bf16_current_[2] = {false, false};  // set by mark_bf16_current, used up by refresh_bf16
};

// Initial value of global element `global_index` of parameter `spec` for `seed`.
double param_init_value(const ParamSpec& spec, uint64_t seed, int64_t global_index);

}  // namespace moecore
