// Fast RoPE: cos/sin come from a table built once before step 0 (make_rope_cache, into the
// backend's memory), so a step does no transcendental math; tokens are split across OpenMP threads.
// Megatron's non-interleaved form: pairs are (x[i], x[i + D/2]).
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "ops/memory.h"
#include "ops/rope.h"

namespace moecore::ops {

int64_t rope_table_elems(int64_t max_pos, int64_t D, double base) {
  MOE_CHECK(max_pos > 0, "[rope] max_pos={} must be > 0: pass the longest sequence length",
            max_pos);
  MOE_CHECK(D > 0 && D % 2 == 0,
            "[rope] head dim D={} must be even and > 0: RoPE rotates pairs (x[i], x[i+D/2])", D);
  MOE_CHECK(base > 0,
            "[rope] base={} must be > 0 (usually 10000): check the rotary base in the model "
            "config",
            base);
  return max_pos * (D / 2);
}

RopeCache make_rope_cache(const Exec& ex, DevPtr<double> cos_PD, DevPtr<double> sin_PD,
                          int64_t max_pos, int64_t D, double base) {
  const int64_t n = rope_table_elems(max_pos, D, base), half = D / 2;
  MOE_CHECK(cos_PD != nullptr && sin_PD != nullptr,
            "[rope] no memory for the tables ({} elements each): allocate them first", n);
  std::vector<double> cos_h(static_cast<size_t>(n)), sin_h(static_cast<size_t>(n));
  for (int64_t i = 0; i < half; ++i) {
    // Same expression as rope_ref, so f64 fast and reference agree to the last bit.
    const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    for (int64_t p = 0; p < max_pos; ++p) {
      const double angle = static_cast<double>(p) * inv_freq;
      cos_h[p * half + i] = std::cos(angle);
      sin_h[p * half + i] = std::sin(angle);
    }
  }
  copy<double>(ex, cos_PD, cos_h.data(), n);
  copy<double>(ex, sin_PD, sin_h.data(), n);
  exec_synchronize(ex);  // the host vectors go out of scope
  return RopeCache{max_pos, D, base, cos_PD, sin_PD};
}

RopeTableBlock::RopeTableBlock(int64_t n, const Exec& ex)
    : ex_(ex),
      n_(n),
      block_(exec_alloc(ex, MemSpace::Device, 2 * static_cast<size_t>(n) * sizeof(double))) {}

RopeTableBlock::~RopeTableBlock() { exec_free(ex_, MemSpace::Device, block_); }

// The block is a base: a throw while the cache is filled frees it.
RopeTables::RopeTables(int64_t max_pos, int64_t D, double base, const Exec& ex)
    : RopeTableBlock(rope_table_elems(max_pos, D, base), ex),
      cache_(make_rope_cache(ex, cos_table(), sin_table(), max_pos, D, base)) {}

namespace {

// Rotation by +angle (forward) or -angle (backward: the inverse, which is the transpose).
// y == x (in place) is fine; partially overlapping buffers are not.
template <typename T>
void rope_rotate(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                 const RopeCache& cache, T sign) {
  const int64_t D = cache.D, half = D / 2;
  MOE_CHECK(D > 0 && D % 2 == 0 && cache.max_pos > 0 && cache.cos_PD != nullptr &&
                cache.sin_PD != nullptr,
            "[rope] cache not built (D={}, max_pos={}, tables {}): use make_rope_cache or "
            "RopeTables",
            D, cache.max_pos, cache.cos_PD != nullptr ? "set" : "missing");
  MOE_CHECK(n_tok >= 0 && n_heads >= 0, "[rope] negative size n_tok={} n_heads={}", n_tok, n_heads);
  // Validate positions up front: a throw inside the OpenMP region would terminate instead.
  for (int64_t t = 0; t < n_tok; ++t) {
    MOE_CHECK(pos_T[t] >= 0 && pos_T[t] < cache.max_pos,
              "[rope] token {} at position {} outside the cache [0, {}): build the cache with "
              "max_pos >= the longest sequence",
              t, pos_T[t], cache.max_pos);
  }
  const double* cos_PD = raw_ptr(cache.cos_PD);
  const double* sin_PD = raw_ptr(cache.sin_PD);
  // Threads only pay off on large inputs; a decode-sized call stays serial.
#pragma omp parallel for schedule(static) if (n_tok * n_heads * D >= (int64_t{1} << 15))
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* cos_D = cos_PD + static_cast<int64_t>(pos_T[t]) * half;
    const double* sin_D = sin_PD + static_cast<int64_t>(pos_T[t]) * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      const T* xh = x + (t * n_heads + h) * D;
      T* yh = y + (t * n_heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const T c = static_cast<T>(cos_D[i]), s = sign * static_cast<T>(sin_D[i]);
        const T x1 = xh[i], x2 = xh[i + half];  // both read before either is written
        // Explicit multiply-adds, so no compiler contracts them its own way (GCC fuses a * b - c *
        // d in C++ whenever the ISA has FMA): the product x2 s (x1 s) rounded, then one fused
        // multiply-add. The CUDA kernel does the same operations: bitwise the same results.
        yh[i] = std::fma(x1, c, -(x2 * s));
        yh[i + half] = std::fma(x2, c, x1 * s);
      }
    }
  }
}

}  // namespace

namespace cpu {

template <typename T>
void rope_forward(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                  const RopeCache& cache) {
  rope_rotate(y, x, pos_T, n_tok, n_heads, cache, T(1));
}

template <typename T>
void rope_backward(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                   const RopeCache& cache) {
  rope_rotate(dx, dy, pos_T, n_tok, n_heads, cache, T(-1));
}

#define MOECORE_INSTANTIATE_ROPE(T)                                                                \
  template void rope_forward<T>(T*, const T*, const int32_t*, int64_t, int64_t, const RopeCache&); \
  template void rope_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, const RopeCache&);
MOECORE_INSTANTIATE_ROPE(float)
MOECORE_INSTANTIATE_ROPE(double)
#undef MOECORE_INSTANTIATE_ROPE

}  // namespace cpu
}  // namespace moecore::ops
