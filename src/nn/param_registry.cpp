#include "nn/param_registry.h"

#include <algorithm>
#include <array>
#include <bit>
#include <vector>

#include "core/rng.h"
#include "core/shape.h"
#include "ops/cast.h"
#include "ops/memory.h"

namespace moecore {

std::vector<int64_t> Param::local_shape() const {
  std::vector<int64_t> s = spec.global_shape;
  for (const DimSlice& d : {spec.slice.first(), spec.slice.second}) {
    if (d.split()) s[d.dim] = d.local_extent();
  }
  return s;
}

int64_t Param::local_numel() const {
  // The product of local_shape(), without building it: the optimizer asks inside a step.
  int64_t n = 1;
  for (size_t i = 0; i < spec.global_shape.size(); ++i) {
    const int d = static_cast<int>(i);
    n *= d == spec.slice.dim            ? spec.slice.length * spec.slice.parts
         : d == spec.slice.second.dim ? spec.slice.second.local_extent()
                                        : spec.global_shape[i];
  }
  return n;
}

int64_t Param::global_numel() const { return shape_numel(spec.global_shape); }

Param& ParamRegistry::add(ParamSpec spec) {
  MOE_CHECK(find(spec.name) == nullptr, "[params] parameter '{}' registered twice", spec.name);
  MOE_CHECK(!spec.global_shape.empty(), "[params] parameter '{}' has no shape", spec.name);
  for (int64_t d : spec.global_shape) {
    MOE_CHECK(d > 0, "[params] parameter '{}' has a dimension of size {}", spec.name, d);
  }
  const auto check_dim = [&](const DimSlice& d) {
    if (!d.split()) return;
    const int nd = static_cast<int>(spec.global_shape.size());
    MOE_CHECK(d.dim < nd && d.parts >= 1 && spec.global_shape[d.dim] % d.parts == 0 &&
                  d.offset >= 0 && d.length > 0 &&
                  d.offset + d.length <= spec.global_shape[d.dim] / d.parts,
              "[params] slice [{}, +{}) of {} part(s) on dim {} does not fit '{}'", d.offset,
              d.length, d.parts, d.dim, spec.name);
  };
  check_dim(spec.slice.first());
  check_dim(spec.slice.second);
  MOE_CHECK(!spec.slice.second.split() || spec.slice.second.dim > spec.slice.dim,
            "[params] '{}': the second split dimension {} must come after the first ({})",
            spec.name, spec.slice.second.dim, spec.slice.dim);
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
  MOE_CHECK(master_ || bf16_copies_, "[params] no master values without bf16 copies");
  const bool own32 = bf16_copies_ && !bf16_widened_;  // the native path's f32 copies
  for (int k = 0; k < 2; ++k) {
    int64_t n = 0, n32 = 0;
    for (Param& p : params_) {
      if (static_cast<int>(p.spec.kind) != k) continue;
      p.offset = n;
      n += p.local_numel();
      if (own32 && !p.spec.bf16_only) n32 += p.local_numel();
    }
    numel_[k] = n;
    const char* kname = k == 0 ? "params.dense" : "params.expert";
    data_[k] = master_ ? arena.alloc_bytes(n * esize, kname, MemKind::Weights) : nullptr;
    grad_[k] = arena.alloc_bytes(n * esize, kname, MemKind::Grads);
    if (bf16_copies_ && !bf16_widened_) data16_[k] = arena.alloc<bf16>(n, kname, MemKind::Weights);
    if (bf16_copies_ && bf16_widened_) data16w_[k] = arena.alloc<float>(n, kname, MemKind::Weights);
    values32_[k] = own32 ? arena.alloc<float>(n32, kname, MemKind::Weights) : nullptr;
  }
  int64_t at32[2] = {0, 0};
  for (Param& p : params_) {
    int k = static_cast<int>(p.spec.kind);
    p.data = data_[k] ? dev_ptr_cast<char>(data_[k]) + p.offset * esize : nullptr;
    p.grad = grad_[k] ? dev_ptr_cast<char>(grad_[k]) + p.offset * esize : nullptr;
    p.data16 = data16_[k] ? data16_[k] + p.offset : nullptr;
    p.data16w = data16w_[k] ? data16w_[k] + p.offset : nullptr;
    p.has_data16 = bf16_copies_ && !bf16_widened_;
    p.has_data16w = bf16_copies_ && bf16_widened_;
    p.values32 = p.data16w;
    if (own32 && !p.spec.bf16_only) {
      p.values32 = values32_[k] ? values32_[k] + at32[k] : nullptr;
      at32[k] += p.local_numel();
    }
  }
}

// With the stream key rng_key(seed, spec.name) already computed (once per parameter).
static double init_value(const ParamSpec& spec, uint64_t key, int64_t global_index) {
  if (spec.model_rows >= 0) {  // padding rows are zero (ParamSpec::model_rows)
    int64_t row_numel = 1;
    for (size_t d = 1; d < spec.global_shape.size(); ++d) row_numel *= spec.global_shape[d];
    if (global_index >= spec.model_rows * row_numel) return 0.0;
  }
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
// A parameter's local elements as rows of `inner` contiguous elements, contiguous in the global
// tensor too: `inner` is the product of the dimensions after the last split one, and the rows
// run over the local indices of the dimensions up to it. Row r starts at local element
// r * inner and at global element global_base(r). An unsliced parameter is one row.
struct SliceMap {
  int64_t rows = 1, inner = 1;
  int last = -1;  // the last split dimension
  // Dims [0, last]: local and global extents, and each one's slice (dim -1: whole). Fixed
  // arrays: param_global_index builds one per element.
  static constexpr int kMaxDims = 8;
  std::array<int64_t, kMaxDims> local{}, glob{};
  std::array<DimSlice, kMaxDims> by_dim{};
  explicit SliceMap(const Param& p) {
    const auto& g = p.spec.global_shape;
    const int nd = static_cast<int>(g.size());
    const ParamSlice& sl = p.spec.slice;
    last = sl.second.split() ? sl.second.dim : sl.dim;
    if (last < 0) {
      inner = p.global_numel();
      return;
    }
    MOE_CHECK(last < kMaxDims, "[params] '{}' is split along dimension {}", p.name(), last);
    for (int i = last + 1; i < nd; ++i) inner *= g[i];
    for (int i = 0; i <= last; ++i) {
      DimSlice d{};
      if (i == sl.dim) d = sl.first();
      if (i == sl.second.dim) d = sl.second;
      by_dim[i] = d;
      glob[i] = g[i];
      local[i] = d.split() ? d.local_extent() : g[i];
      rows *= local[i];
    }
  }
  int64_t global_base(int64_t row) const {
    if (last < 0) return 0;
    // The local multi-index of the row (dims [0, last], last fastest), each mapped to its global
    // index, recombined row-major over the global extents.
    int64_t g = 0, stride = 1;
    for (int i = last; i >= 0; --i) {
      const int64_t l = row % local[i];
      row /= local[i];
      const DimSlice& d = by_dim[i];
      g += (d.split() ? d.global_index(l, glob[i]) : l) * stride;
      stride *= glob[i];
    }
    return g * inner;
  }
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t digest_term(uint64_t key, int64_t global_index, uint64_t bits) {
  return splitmix64(key ^ splitmix64(static_cast<uint64_t>(global_index)) ^ bits);
}

// The global indices below this are the model's (ParamSpec::model_rows): the padding rows past
// it take no part in the digest, so every padding of the same model digests alike.
int64_t model_elements(const ParamSpec& spec) {
  int64_t n = spec.model_extent0();
  for (size_t d = 1; d < spec.global_shape.size(); ++d) n *= spec.global_shape[d];
  return n;
}
}  // namespace

uint64_t ParamRegistry::digest(ParamKind kind,
                              const std::function<bool(const Param&)>& counted) const {
  MOE_CHECK(master_, "[params] digest(): the master values are in the distributed optimizer's "
            "shards (param_digest_f32 over them)");
  const bool f32 = dtype_ == DType::F32;
  const size_t elem = f32 ? sizeof(float) : sizeof(double);
  std::vector<unsigned char> staging;  // a device arena's values, read back
  uint64_t total = 0;
  for (const Param& p : params_) {
    if (p.spec.kind != kind || (counted && !counted(p))) continue;
    MOE_CHECK(p.data != nullptr, "[params] digest() before allocate() for '{}'", p.name());
    const void* values = raw_ptr(p.data);
    if (!ex_->on_cpu()) {
      staging.resize(static_cast<size_t>(p.local_numel()) * elem);
      ops::read_back<unsigned char>(*ex_, staging.data(), dev_ptr_cast<const unsigned char>(p.data),
                                    static_cast<int64_t>(staging.size()));
      values = staging.data();
    }
    const uint64_t key = rng_key(0, p.spec.name);
    const SliceMap m(p);
    const int64_t model_end = model_elements(p.spec);
    uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t r = 0; r < m.rows; ++r) {
      const int64_t gbase = m.global_base(r), lbase = r * m.inner;
      for (int64_t i = 0; i < m.inner; ++i) {
        const int64_t l = lbase + i;
        const uint64_t bits = f32 ? std::bit_cast<uint32_t>(static_cast<const float*>(values)[l])
                                  : std::bit_cast<uint64_t>(static_cast<const double*>(values)[l]);
        if (gbase + i < model_end) sum += digest_term(key, gbase + i, bits);
      }
    }
    total += sum;  // unsigned: wraps, so the order of the terms cannot matter
  }
  return total;
}

int64_t param_global_index(const Param& p, int64_t local) {
  const SliceMap m(p);
  return m.global_base(local / m.inner) + local % m.inner;
}

uint64_t param_digest_f32(const Param& p, int64_t begin, const float* values, int64_t count) {
  const uint64_t key = rng_key(0, p.spec.name);
  const int64_t model_end = model_elements(p.spec);
  uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t g = param_global_index(p, begin + i);
    if (g < model_end) sum += digest_term(key, g, std::bit_cast<uint32_t>(values[i]));
  }
  return sum;
}

void param_init_f32(const Param& p, uint64_t seed, int64_t begin, float* out, int64_t count) {
  const uint64_t key = rng_key(seed, p.spec.name);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    out[i] = static_cast<float>(init_value(p.spec, key, param_global_index(p, begin + i)));
  }
}

double param_init_value(const ParamSpec& spec, uint64_t seed, int64_t global_index) {
  return init_value(spec, rng_key(seed, spec.name), global_index);
}

void ParamRegistry::init(uint64_t seed) {
  MOE_CHECK(dtype_ == DType::F32 || dtype_ == DType::F64, "[params] unsupported parameter dtype {}",
            dtype_name(dtype_));
  bf16_current_[0] = bf16_current_[1] = false;  // new values: the copies must be refreshed
  if (!master_) {
    // No master values here: the bf16 values of the same f32 initial values (the distributed
    // optimizer's shards start from these f32 values too: param_init_f32).
    std::vector<float> host;
    for (const Param& p : params_) {
      host.resize(static_cast<size_t>(p.local_numel()));
      param_init_f32(p, seed, 0, host.data(), p.local_numel());
      write_bf16(p, 0, host.data(), p.local_numel());
    }
    return;
  }
  const bool f32 = dtype_ == DType::F32;
  const size_t elem = f32 ? sizeof(float) : sizeof(double);
  std::vector<unsigned char> staging;  // a device arena's values, written here then copied
  for (Param& p : params_) {
    MOE_CHECK(p.data != nullptr, "[params] init() before allocate() for '{}'", p.name());
    void* values = raw_ptr(p.data);
    if (!ex_->on_cpu()) {
      staging.resize(static_cast<size_t>(p.local_numel()) * elem);
      values = staging.data();
    }
    const uint64_t key = rng_key(seed, p.spec.name);  // once per parameter, not per element
    const SliceMap m(p);
    // Each element is a pure function of its global index: the loop order cannot matter.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m.rows; ++r) {
      const int64_t gbase = m.global_base(r), lbase = r * m.inner;
      for (int64_t i = 0; i < m.inner; ++i) {
        double v = init_value(p.spec, key, gbase + i);
        if (f32)
          static_cast<float*>(values)[lbase + i] = static_cast<float>(v);
        else
          static_cast<double*>(values)[lbase + i] = v;
      }
    }
    if (!ex_->on_cpu()) {
      ops::copy<unsigned char>(*ex_, dev_ptr_cast<unsigned char>(p.data), staging.data(),
                               static_cast<int64_t>(staging.size()));
      exec_synchronize(*ex_);  // the staging is reused for the next parameter
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
    refresh_bf16(static_cast<ParamKind>(k), 0, numel_[k]);
  }
}

void ParamRegistry::refresh_bf16(ParamKind kind, int64_t offset, int64_t count) {
  if (!bf16_copies_) return;
  const int k = static_cast<int>(kind);
  MOE_CHECK(offset >= 0 && count >= 0 && offset + count <= numel_[k],
            "[params] bf16 refresh of elements [{}, {}) outside the {} {} values", offset,
            offset + count, numel_[k], k == 0 ? "dense" : "expert");
  if (master_) {
    const DevPtr<const float> src = dev_ptr_cast<const float>(data_[k]) + offset;
    if (data16w_[k] != nullptr)
      ops::round_f32_to_bf16(*ex_, data16w_[k] + offset, src, count);
    else
      ops::cast_f32_to_bf16(*ex_, data16_[k] + offset, src, count);
  }
  refresh_values32(kind, offset, count);
}

void ParamRegistry::refresh_values32(ParamKind kind, int64_t offset, int64_t count) {
  if (!bf16_copies_ || bf16_widened_) return;  // widened: values32 is the compute copy itself
  for (const Param& p : params_) {
    if (p.spec.kind != kind || p.spec.bf16_only) continue;
    const int64_t b = std::max(offset, p.offset);
    const int64_t e = std::min(offset + count, p.offset + p.local_numel());
    if (b >= e) continue;
    ops::cast_bf16_to_f32(*ex_, p.values32 + (b - p.offset), DevPtr<const bf16>(p.data16 + (b - p.offset)),
                          e - b);
  }
}

void ParamRegistry::write_bf16(const Param& p, int64_t begin, const float* host, int64_t count) {
  MOE_CHECK(bf16_copies_, "[params] write_bf16 without --bf16");
  MOE_CHECK(begin >= 0 && count >= 0 && begin + count <= p.local_numel(),
            "[params] write_bf16 of elements [{}, {}) outside '{}' ({} local elements)", begin,
            begin + count, p.name(), p.local_numel());
  // On the host, element by element: core/dtype.h's rounding is the cast ops' (bitwise).
  std::vector<bf16> h(static_cast<size_t>(count));
  std::vector<float> w(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    h[i] = float_to_bf16(host[i]);
    w[i] = bf16_to_float(h[i]);
  }
  if (bf16_widened_) {
    ops::copy<float>(*ex_, p.data16w + begin, w.data(), count);
  } else {
    ops::copy<bf16>(*ex_, p.data16 + begin, h.data(), count);
    if (p.values32 != nullptr) ops::copy<float>(*ex_, p.values32 + begin, w.data(), count);
  }
  exec_synchronize(*ex_);  // the host vectors go out of scope
}

int64_t ParamRegistry::values32_numel(ParamKind kind) const {
  if (!bf16_copies_ || bf16_widened_) return 0;
  int64_t n = 0;
  for (const Param& p : params_) {
    if (p.spec.kind == kind && !p.spec.bf16_only) n += p.local_numel();
  }
  return n;
}

ParamRegistry::Gathered ParamRegistry::gathered_values(ParamKind kind) const {
  const int k = static_cast<int>(kind);
  if (master_) return {data_[k], dtype_};
  if (bf16_widened_) return {DevPtr<void>(data16w_[k]), DType::F32};
  return {DevPtr<void>(data16_[k]), DType::BF16};
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
