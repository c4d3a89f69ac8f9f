// The parameter registry: every parameter's global name and shape, which slice this rank
// holds, and whether it is a dense or an expert parameter. Values and gradients live in one
// flat buffer per kind (dense, expert) so that optimizers and gradient buckets see contiguous
// memory; initialization is a pure function of (seed, name, global element index).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"

namespace moecore {

enum class ParamKind : uint8_t { Dense, Expert };
enum class ParamInit : uint8_t { Normal, Ones, Zeros };

// One split dimension of a parameter: the dimension is `parts` equal chunks (SwiGLU's [gate; up]
// halves are two), and this rank holds indices [offset, offset + length) of every chunk, the
// chunks' pieces back to back in its local tensor. dim = -1: not split.
struct DimSlice {
  int dim = -1;
  int64_t offset = 0;
  int64_t length = 0;
  int parts = 1;

  bool split() const { return dim >= 0; }
  // This rank's extent of the dimension.
  int64_t local_extent() const { return length * parts; }
  // The global index along the dimension (of global extent `extent`) of local index `l`.
  int64_t global_index(int64_t l, int64_t extent) const {
    return (l / length) * (extent / parts) + offset + l % length;
  }
};

// The slice of the global tensor this rank holds: up to two split dimensions, `dim` (expert
// parallelism's experts, or tensor parallelism's rows / columns) and `second` (a later dimension:
// expert tensor parallelism inside an expert-parallel slice). dim = -1 means the whole tensor.
struct ParamSlice {
  int dim = -1;
  int64_t offset = 0;
  int64_t length = 0;
  int parts = 1;
  DimSlice second{};

  DimSlice first() const { return DimSlice{dim, offset, length, parts}; }
  bool whole() const { return dim < 0; }
  // One run of dimension 0 (or the whole tensor): contiguous in the global tensor's row-major
  // order, the only form the flat (distributed optimizer) checkpoint slices address.
  bool contiguous() const { return dim <= 0 && parts == 1 && !second.split(); }
};

// The tensor-parallel role of a parameter, for the gradient reductions and the norm: sharded
// (each rank of the TP group holds its own slice), replicated with equal gradients on every TP
// rank, or replicated with partial gradients (each TP rank's tokens or heads) that are summed
// over the TP group before the data-parallel reduction. TP is the attention grid's for dense
// parameters and expert TP for expert ones.
enum class TpRole : uint8_t { Sharded, Replicated, ReplicatedPartialGrad };

// A rank's place in a tensor-parallel group, as the layers that slice their parameters see it
// (nn/ knows no process groups: parallel::TensorParallel::shard() gives it).
struct TpShard {
  int rank = 0;
  int size = 1;
  // The slice of dimension `dim` (of extent `extent`, in `parts` equal chunks) this rank holds:
  // its equal share of every chunk; the whole tensor on one rank.
  ParamSlice slice(int dim, int64_t extent, int parts = 1) const {
    if (size == 1) return {};
    const int64_t len = extent / parts / size;
    return ParamSlice{dim, rank * len, len, parts};
  }
  // The roles of a parameter of the layer with this shard (every role Replicated on one rank):
  // a slice of it held here, or replicated values whose gradient here is a partial sum (a
  // row-parallel bias added by TP rank 0, weights applied to this rank's heads or tokens).
  TpRole sharded() const { return size > 1 ? TpRole::Sharded : TpRole::Replicated; }
  TpRole partial() const { return size > 1 ? TpRole::ReplicatedPartialGrad : TpRole::Replicated; }
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> global_shape;
  ParamInit init = ParamInit::Normal;
  double init_std = 0.02;
  ParamKind kind = ParamKind::Dense;
  bool weight_decay = true;  // Megatron: no decay on norms and biases
  ParamSlice slice{};
  // Read only by kernels that take its bf16 values under --bf16 (the GEMMs, the bf16 embedding
  // lookup): no f32 copy of them is kept (Param::values32 null on the native bf16 GEMM path).
  bool bf16_only = false;
  // Set by the layer that registers it (a one-rank TP group makes it irrelevant).
  TpRole tp_role = TpRole::Replicated;
  // The rows of dimension 0 that belong to the model (-1: all of them). Rows past them are
  // padding (the vocabulary padded for tensor parallelism): initialised to zero, never read by
  // the model, so their gradients and AdamW moments stay zero and the values stay zero; a
  // checkpoint and an export hold only the model's rows (zero-filled again at load), so the
  // stored model is the same whatever the padding.
  int64_t model_rows = -1;
  // A copy of a parameter that another pipeline stage holds as well: the tied output head of a
  // last stage without the embedding (Megatron's shared embedding). Same name and initial
  // values; its gradient is summed with the first stage's copy's before the data-parallel
  // reduction, so both update identically. Counted once (by the first stage) in the gradient
  // norm and the weights digest, and written once in a checkpoint.
  bool pipeline_copy = false;
  // The model's extent of dimension 0.
  int64_t model_extent0() const { return model_rows >= 0 ? model_rows : global_shape.at(0); }
};

struct Param {
  ParamSpec spec;
  DType dtype = DType::F32;
  int64_t offset = 0;  // element offset into its kind's flat buffers
  // The master values (the registry's dtype): what the optimizer updates and a checkpoint
  // saves. Null under --bf16 when the registry holds no master values (their fp32 master is in
  // the distributed optimizer's shards: ParamRegistry::holds_master()).
  DevPtr<void> data = nullptr;
  DevPtr<void> grad = nullptr;
  // --bf16 (Megatron's bf16 parameters): every layer reads the parameter's bf16 values, kept
  // beside the master in one of two formats: bf16 (data16, what the native bf16 GEMMs read) or
  // the same bf16 values widened to f32 (data16w, what the widened-bf16 GEMM path reads). The
  // has_ flags are set by allocate() in both passes (the pointers are null while planning).
  DevPtr<bf16> data16 = nullptr;
  DevPtr<float> data16w = nullptr;
  bool has_data16 = false;
  bool has_data16w = false;
  bool has_bf16_copy() const { return has_data16 || has_data16w; }
  // --bf16: the bf16 values widened to f32 for the f32 kernels that read them (norms, biases,
  // the router, the shared expert gate): data16w on the widened path, an own copy on the native
  // path; none for a bf16_only parameter on the native path.
  DevPtr<float> values32 = nullptr;

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
    MOE_CHECK(DTypeOf<T>::value == dtype, "[params] '{}' is {} not {}", spec.name,
              dtype_name(dtype), dtype_name(DTypeOf<T>::value));
    return dev_ptr_cast<T>(grad);
  }
  // The values the forward and backward read as T: the master values, or under --bf16 their
  // bf16 values widened to f32 (values32; a bf16_only parameter has none on the native path).
  template <typename T>
  DevPtr<T> compute_as() const {
    if (!has_bf16_copy()) return data_as<T>();
    MOE_CHECK((std::is_same_v<T, float>), "[params] '{}': bf16 values read as {}", spec.name,
              dtype_name(DTypeOf<T>::value));
    MOE_CHECK(!spec.bf16_only || has_data16w,
              "[params] '{}' is read by an f32 kernel under --bf16 but registered bf16_only",
              spec.name);
    return dev_ptr_cast<T>(values32);
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
  // master: keep the fp32 master values here (Param::data); false when the distributed
  // optimizer holds them in its shards (then init() writes the bf16 values directly and only
  // the optimizer's shards hold fp32 values).
  void enable_bf16_copies(bool widened = false, bool master = true) {
    bf16_copies_ = true;
    bf16_widened_ = widened;
    master_ = master;
  }
  bool has_bf16_copies() const { return bf16_copies_; }
  // Whether Param::data holds the master values (always without --bf16).
  bool holds_master() const { return master_; }
  // The buffer of the kind's values that the distributed optimizer's gathers fill: the master
  // values, or without them here the bf16 compute copy (bf16, or widened to f32).
  struct Gathered {
    DevPtr<void> data = nullptr;
    DType dtype = DType::F32;
  };
  Gathered gathered_values(ParamKind kind) const;
  // The f32 copies (values32, native path) of the parameters overlapping elements
  // [offset, offset + count) of the kind's flat buffer, from their bf16 values.
  void refresh_values32(ParamKind kind, int64_t offset, int64_t count);
  bool bf16_widened() const { return bf16_copies_ && bf16_widened_; }
  // The copies from the values, with the cast ops on the arena's context (without the master
  // values here: the f32 copies, values32, from the bf16 values).
  void refresh_bf16();
  // The next refresh_bf16() skips `kind`, then converts as usual: for an optimizer that rewrote
  // every bf16 copy of `kind` in the pass that updated the values (ops::adamw_step's p16), and
  // for values that arrive later than the step (the distributed optimizer's deferred gathers,
  // --overlap-param-gather), which whoever completes them converts per range with
  // refresh_bf16(kind, offset, count). Valid only when nothing else changes the values of
  // `kind` before that refresh (the trainer refreshes right after the optimizer step).
  void mark_bf16_current(ParamKind kind) { bf16_current_[static_cast<int>(kind)] = true; }
  // The copies of elements [offset, offset + count) of the kind's flat buffer (the same
  // conversion as refresh_bf16(), element by element). Without the master values here the bf16
  // copies are what the gathers fill: only their f32 copies (values32) are refreshed.
  void refresh_bf16(ParamKind kind, int64_t offset, int64_t count);
  // Writes the bf16 values (and their f32 copies) of parameter p's local elements
  // [begin, begin + count) from f32 values on the host (a checkpoint's weights): the same
  // rounding as refresh_bf16(). Under --bf16 only.
  void write_bf16(const Param& p, int64_t begin, const float* host, int64_t count);

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
  // equal digests; a changed value changes it (up to hash collisions). Padding rows (past
  // ParamSpec::model_rows) are left out: the digest is the model's, whatever the padding.
  // counted: the parameters to include (null: all; tensor parallelism counts a replicated
  // parameter on one TP rank).
  uint64_t digest(ParamKind kind, const std::function<bool(const Param&)>& counted = {}) const;

  Param& get(const std::string& name);
  const Param* find(const std::string& name) const;
  std::deque<Param>& params() { return params_; }
  const std::deque<Param>& params() const { return params_; }

  DType dtype() const { return dtype_; }
  // The execution context of the arena the values live in (from allocate()).
  const Exec& exec() const { return *ex_; }
  int64_t numel(ParamKind kind) const { return numel_[static_cast<int>(kind)]; }
  // The elements of the kind with an own f32 copy of their bf16 values (values32 on the native
  // bf16 path; 0 otherwise).
  int64_t values32_numel(ParamKind kind) const;
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
  DevPtr<float> values32_[2] = {nullptr, nullptr};  // the native path's f32 copies, per kind
  bool bf16_copies_ = false;
  bool bf16_widened_ = false;
  bool master_ = true;
  bool bf16_current_[2] = {false, false};  // set by mark_bf16_current, used up by refresh_bf16
};

// Initial value of global element `global_index` of parameter `spec` for `seed`.
double param_init_value(const ParamSpec& spec, uint64_t seed, int64_t global_index);
// The global index of p's local element `local` (row-major in both).
int64_t param_global_index(const Param& p, int64_t local);
// The digest term of p's local elements [begin, begin + count) with f32 `values` (ParamRegistry::
// digest's sum restricted to them): the distributed optimizer's master shards digest as the
// whole tensors would.
uint64_t param_digest_f32(const Param& p, int64_t begin, const float* values, int64_t count);
// The initial f32 values of p's local elements [begin, begin + count) (what init() writes).
void param_init_f32(const Param& p, uint64_t seed, int64_t begin, float* out, int64_t count);

}  // namespace moecore
