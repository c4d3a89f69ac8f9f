#include "nn/param_registry.h"

#include <bit>

#include "core/rng.h"
#include "ops/cast.h"
#include "ops/memory.h"

namespace moecore {

std::vector<int64_t> Param::local_shape() const {
  std::vector<int64_t> s = spec.global_shape;
  if (spec.slice.dim >= 0) s[spec.slice.dim] = spec.slice.length;
  return s;
}

int64_t Param::local_numel() const {
  // The product of local_shape(), without building it: the optimizer asks inside a step.
  int64_t n = 1;
  for (size_t i = 0; i < spec.global_shape.size(); ++i) {
    n *= static_cast<int>(i) == spec.slice.dim ? spec.slice.length : spec.global_shape[i];
  }
  return n;
}

int64_t Param::global_numel() const {
  int64_t n = 1;
  for (int64_t d : spec.global_shape) n *= d;
  return n;
}

Param& ParamRegistry::add(ParamSpec spec) {
  MOE_CHECK(find(spec.name) == nullptr, "[params] parameter '{}' registered twice", spec.name);
  MOE_CHECK(!spec.global_shape.empty(), "[params] parameter '{}' has no shape", spec.name);
  for (int64_t d : spec.global_shape) {
    MOE_CHECK(d > 0, "[params] parameter '{}' has a dimension of size {}", spec.name, d);
  }
  if (spec.slice.dim >= 0) {
    MOE_CHECK(spec.slice.dim < static_cast<int>(spec.global_shape.size()) &&
                  spec.slice.offset >= 0 && spec.slice.length > 0 &&
                  spec.slice.offset + spec.slice.length <= spec.global_shape[spec.slice.dim],
              "[params] slice [{}, +{}) on dim {} does not fit '{}'", spec.slice.offset,
              spec.slice.length, spec.slice.dim, spec.name);
  }
  MOE_CHECK(data_[0] == nullptr && data_[1] == nullptr, "[params] '{}' registered after allocate()",
            spec.name);
  Param p;
  p.spec = std::move(spec);
  p.dtype = dtype_;
  index_.emplace(p.name(), params_.size());
  params_.push_back(std::move(p));
  return params_.back();
}

void ParamRegistry::allocate(Arena& arena) {
  ex_ = &arena.exec();
  size_t esize = dtype_size(dtype_);
  for (int k = 0; k < 2; ++k) {
    int64_t n = 0;
    for (Param& p : params_) {
      if (static_cast<int>(p.spec.kind) != k) continue;
      p.offset = n;
      n += p.local_numel();
    }
    numel_[k] = n;
    const char* kname = k == 0 ? "params.dense" : "params.expert";
    data_[k] = arena.alloc_bytes(n * esize, kname, MemKind::Weights);
    grad_[k] = arena.alloc_bytes(n * esize, kname, MemKind::Grads);
    if (bf16_copies_ && !bf16_widened_) data16_[k] = arena.alloc<bf16>(n, kname, MemKind::Weights);
    if (bf16_copies_ && bf16_widened_) data16w_[k] = arena.alloc<float>(n, kname, MemKind::Weights);
  }
  for (Param& p : params_) {
    int k = static_cast<int>(p.spec.kind);
    p.data = data_[k] ? dev_ptr_cast<char>(data_[k]) + p.offset * esize : nullptr;
    p.grad = grad_[k] ? dev_ptr_cast<char>(grad_[k]) + p.offset * esize : nullptr;
    p.data16 = data16_[k] ? data16_[k] + p.offset : nullptr;
    p.data16w = data16w_[k] ? data16w_[k] + p.offset : nullptr;
    p.has_data16 = bf16_copies_ && !bf16_widened_;
    p.has_data16w = bf16_copies_ && bf16_widened_;
  }
}

// With the stream key rng_key(seed, spec.name) already computed (once per parameter).
static double init_value(const ParamSpec& spec, uint64_t key, int64_t global_index) {
  switch (spec.init) {
    case ParamInit::Ones:
      return 1.0;
    case ParamInit::Zeros:
      return 0.0;
    case ParamInit::Normal:
      return spec.init_std * rng_normal(key, static_cast<uint64_t>(global_index));
  }
  return 0.0;
}

namespace {
// A parameter's local elements as rows of `inner` contiguous elements: row (o, s) is index s of
// the sliced dimension's local part within outer index o; it starts at global element
// global_base(o, s). An unsliced parameter is one row.
struct SliceMap {
  int64_t outer = 1, inner = 1, glen = 1, llen = 1, off = 0;
  explicit SliceMap(const Param& p) {
    const auto& g = p.spec.global_shape;
    const int nd = static_cast<int>(g.size());
    const int sd = p.spec.slice.dim;
    if (sd < 0) {
      inner = p.global_numel();
      return;
    }
    for (int i = 0; i < sd; ++i) outer *= g[i];
    for (int i = sd + 1; i < nd; ++i) inner *= g[i];
    glen = g[sd];
    llen = p.spec.slice.length;
    off = p.spec.slice.offset;
  }
  int64_t global_base(int64_t o, int64_t s) const { return (o * glen + off + s) * inner; }
  int64_t local_base(int64_t o, int64_t s) const { return (o * llen + s) * inner; }
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t ParamRegistry::digest(ParamKind kind) const {
  uint64_t total = 0;
  for (const Param& p : params_) {
    if (p.spec.kind != kind) continue;
    MOE_CHECK(p.data != nullptr, "[params] digest() before allocate() for '{}'", p.name());
    const uint64_t key = rng_key(0, p.spec.name);
    const SliceMap m(p);
    const bool f32 = dtype_ == DType::F32;
    uint64_t sum = 0;
#pragma omp parallel for collapse(2) schedule(static) reduction(+ : sum)
    for (int64_t o = 0; o < m.outer; ++o) {
      for (int64_t s = 0; s < m.llen; ++s) {
        const int64_t gbase = m.global_base(o, s), lbase = m.local_base(o, s);
        for (int64_t i = 0; i < m.inner; ++i) {
          const int64_t l = lbase + i;
          const uint64_t bits =
              f32 ? std::bit_cast<uint32_t>(static_cast<const float*>(raw_ptr(p.data))[l])
                  : std::bit_cast<uint64_t>(static_cast<const double*>(raw_ptr(p.data))[l]);
          sum += splitmix64(key ^ splitmix64(static_cast<uint64_t>(gbase + i)) ^ bits);
        }
      }
    }
    total += sum;  // unsigned: wraps, so the order of the terms cannot matter
  }
  return total;
}

double param_init_value(const ParamSpec& spec, uint64_t seed, int64_t global_index) {
  return init_value(spec, rng_key(seed, spec.name), global_index);
}

void ParamRegistry::init(uint64_t seed) {
  MOE_CHECK(dtype_ == DType::F32 || dtype_ == DType::F64, "[params] unsupported parameter dtype {}",
            dtype_name(dtype_));
  bf16_current_[0] = bf16_current_[1] = false;  // new values: the copies must be refreshed
  for (Param& p : params_) {
    MOE_CHECK(p.data != nullptr, "[params] init() before allocate() for '{}'", p.name());
    const uint64_t key = rng_key(seed, p.spec.name);  // once per parameter, not per element
    const SliceMap m(p);
    // Each element is a pure function of its global index: the loop order cannot matter.
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t o = 0; o < m.outer; ++o) {
      for (int64_t s = 0; s < m.llen; ++s) {
        const int64_t gbase = m.global_base(o, s), lbase = m.local_base(o, s);
        for (int64_t i = 0; i < m.inner; ++i) {
          double v = init_value(p.spec, key, gbase + i);
          if (dtype_ == DType::F32)
            static_cast<float*>(raw_ptr(p.data))[lbase + i] = static_cast<float>(v);
          else
            static_cast<double*>(raw_ptr(p.data))[lbase + i] = v;
        }
      }
    }
  }
}

void ParamRegistry::refresh_bf16() {
  if (!bf16_copies_) return;
  MOE_CHECK(dtype_ == DType::F32, "[params] bf16 copies need f32 master values, not {}",
            dtype_name(dtype_));
  for (int k = 0; k < 2; ++k) {
    if (bf16_current_[k]) {  // the optimizer wrote these copies with the update
      bf16_current_[k] = false;
      continue;
    }
    const DevPtr<const float> src = dev_ptr_cast<const float>(data_[k]);
    if (data16w_[k] != nullptr)
      ops::round_f32_to_bf16(*ex_, data16w_[k], src, numel_[k]);
    else
      ops::cast_f32_to_bf16(*ex_, data16_[k], src, numel_[k]);
  }
}

void ParamRegistry::refresh_bf16(ParamKind kind, int64_t offset, int64_t count) {
  if (!bf16_copies_) return;
  const int k = static_cast<int>(kind);
  MOE_CHECK(offset >= 0 && count >= 0 && offset + count <= numel_[k],
            "[params] bf16 refresh of elements [{}, {}) outside the {} {} values", offset,
            offset + count, numel_[k], k == 0 ? "dense" : "expert");
  const DevPtr<const float> src = dev_ptr_cast<const float>(data_[k]) + offset;
  if (data16w_[k] != nullptr)
    ops::round_f32_to_bf16(*ex_, data16w_[k] + offset, src, count);
  else
    ops::cast_f32_to_bf16(*ex_, data16_[k] + offset, src, count);
}

void ParamRegistry::zero_grads() {
  for (int k = 0; k < 2; ++k) {
    if (grad_[k] != nullptr)
      ops::zero(*ex_, dev_ptr_cast<char>(grad_[k]), numel_[k] * int64_t(dtype_size(dtype_)));
  }
}

Param& ParamRegistry::get(const std::string& name) {
  const auto it = index_.find(name);
  MOE_CHECK(it != index_.end(), "[params] no parameter named '{}'", name);
  return params_[it->second];
}

const Param* ParamRegistry::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

}  // namespace moecore
