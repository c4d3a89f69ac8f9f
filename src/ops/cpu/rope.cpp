// Fast RoPE: cos/sin come from a table built once before step 0 (make_rope_cache), so a step
// does no transcendental math; tokens are split across OpenMP threads. Megatron's
// non-interleaved form: pairs are (x[i], x[i + D/2]).
#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "ops/rope.h"

namespace moecore::ops {

RopeCache make_rope_cache(int64_t max_pos, int64_t D, double base) {
  MOE_CHECK(max_pos > 0, "[rope] max_pos={} must be > 0: pass the longest sequence length",
            max_pos);
  MOE_CHECK(D > 0 && D % 2 == 0,
            "[rope] head dim D={} must be even and > 0: RoPE rotates pairs (x[i], x[i+D/2])", D);
  MOE_CHECK(base > 0,
            "[rope] base={} must be > 0 (usually 10000): check the rotary base in the model "
            "config",
            base);
  RopeCache cache;
  cache.max_pos = max_pos;
  cache.D = D;
  cache.base = base;
  const int64_t half = D / 2;
  cache.cos_PD.resize(max_pos * half);
  cache.sin_PD.resize(max_pos * half);
  for (int64_t i = 0; i < half; ++i) {
    // Same expression as rope_ref, so f64 fast and reference agree to the last bit.
    const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    for (int64_t p = 0; p < max_pos; ++p) {
      const double angle = static_cast<double>(p) * inv_freq;
      cache.cos_PD[p * half + i] = std::cos(angle);
      cache.sin_PD[p * half + i] = std::sin(angle);
    }
  }
  return cache;
}

namespace {

// Rotation by +angle (forward) or -angle (backward: the inverse, which is the transpose).
// y == x (in place) is fine; partially overlapping buffers are not.
template <typename T>
void rope_rotate(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                 const RopeCache& cache, T sign) {
  const int64_t D = cache.D, half = D / 2;
  MOE_CHECK(D > 0 && D % 2 == 0 &&
                static_cast<int64_t>(cache.cos_PD.size()) == cache.max_pos * half &&
                static_cast<int64_t>(cache.sin_PD.size()) == cache.max_pos * half,
            "[rope] cache not built (D={}, max_pos={}, {} cos entries): use make_rope_cache", D,
            cache.max_pos, cache.cos_PD.size());
  MOE_CHECK(n_tok >= 0 && n_heads >= 0, "[rope] negative size n_tok={} n_heads={}", n_tok, n_heads);
  // Validate positions up front: a throw inside the OpenMP region would terminate instead.
  for (int64_t t = 0; t < n_tok; ++t) {
    MOE_CHECK(pos_T[t] >= 0 && pos_T[t] < cache.max_pos,
              "[rope] token {} at position {} outside the cache [0, {}): build the cache with "
              "max_pos >= the longest sequence",
              t, pos_T[t], cache.max_pos);
  }
  const double* cos_PD = cache.cos_PD.data();
  const double* sin_PD = cache.sin_PD.data();
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
        yh[i] = x1 * c - x2 * s;
        yh[i + half] = x2 * c + x1 * s;
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
