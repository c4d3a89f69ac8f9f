// Plain-loop RoPE (Megatron's non-interleaved rotate_half form): the oracle for the fast path.
// Angles are computed directly in double from `base` for every element, so the oracle shares
// nothing with the fast path's cache.
#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "ops/rope.h"

namespace moecore::ops {

namespace {

// Rotates each pair (x[i], x[i + D/2]) by `sign` * pos * base^(-2i/D); sign -1 is the inverse,
// which for a rotation is also the transpose, hence the backward.
template <typename T>
void rope_rotate_ref(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                     int64_t D, double base, double sign) {
  MOE_CHECK(D > 0 && D % 2 == 0,
            "[rope_ref] head dim D={} must be even and > 0: RoPE rotates pairs (x[i], x[i+D/2])",
            D);
  MOE_CHECK(base > 0,
            "[rope_ref] base={} must be > 0 (usually 10000): check the rotary base in the model "
            "config",
            base);
  MOE_CHECK(n_tok >= 0 && n_heads >= 0, "[rope_ref] negative size n_tok={} n_heads={}", n_tok,
            n_heads);
  const int64_t half = D / 2;
  for (int64_t t = 0; t < n_tok; ++t) {
    MOE_CHECK(pos_T[t] >= 0, "[rope_ref] token {} has negative position {}", t, pos_T[t]);
    for (int64_t h = 0; h < n_heads; ++h) {
      const T* xh = x + (t * n_heads + h) * D;
      T* yh = y + (t * n_heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos_T[t]) *
                             std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double c = std::cos(angle), s = sign * std::sin(angle);
        // Read both halves before writing: y may alias x.
        const double x1 = static_cast<double>(xh[i]), x2 = static_cast<double>(xh[i + half]);
        yh[i] = static_cast<T>(x1 * c - x2 * s);
        yh[i + half] = static_cast<T>(x2 * c + x1 * s);
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward_ref(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                      int64_t D, double base) {
  rope_rotate_ref(y, x, pos_T, n_tok, n_heads, D, base, 1.0);
}

template <typename T>
void rope_backward_ref(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                       int64_t D, double base) {
  rope_rotate_ref(dx, dy, pos_T, n_tok, n_heads, D, base, -1.0);
}

#define MOECORE_INSTANTIATE_ROPE_REF(T)                                                       \
  template void rope_forward_ref<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t,  \
                                    double);                                                  \
  template void rope_backward_ref<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                     double);
MOECORE_INSTANTIATE_ROPE_REF(float)
MOECORE_INSTANTIATE_ROPE_REF(double)
#undef MOECORE_INSTANTIATE_ROPE_REF

}  // namespace moecore::ops
