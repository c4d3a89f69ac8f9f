// Dropout fast path: OpenMP over rows (s, b); per row the keep factors come 64 columns at a time
// from SIMD lanes of Philox (dropout_mask.h). Each element is a pure function of its inputs and
// indices, so the results do not depend on the thread count and equal the reference bitwise.
#include <cmath>

#include "core/check.h"
#include "ops/cpu/dropout_mask.h"
#include "ops/dropout.h"

namespace moecore::ops {

namespace cpu {

namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t{1} << 14;

// out = x * factor, or fma(x, factor, base) (one rounding, see dropout.h), for every element;
// base and x may alias out.
template <typename T, bool kAdd>
void dropout_rows(T* out, const T* base, const T* x, double p, uint64_t key,
                  const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0,
                  const char* op) {
  check_dropout_args(p, counters, S, B, C, s0, op);
  const uint32_t threshold = dropout_threshold(p);
  const T scale = dropout_scale<T>(p);
  const int64_t iteration = counters ? counters->iteration : 0;
  const int64_t sample0 = counters ? counters->sample0 : 0;
#pragma omp parallel for schedule(static) if (S * B * C >= kParallelMin)
  for (int64_t row = 0; row < S * B; ++row) {
    const int64_t s = row / B, b = row % B;
    const DropoutRow r(key, iteration, sample0 + b, s0 + s, threshold);
    T* o = out + row * C;
    const T* xr = x + row * C;
    const T* br = kAdd ? base + row * C : nullptr;
    alignas(64) T m[kDropoutChunk];
    for (int64_t c0 = 0; c0 < C; c0 += kDropoutChunk) {
      const int64_t w = C - c0 < kDropoutChunk ? C - c0 : kDropoutChunk;
      if (threshold == 0) {
        for (int64_t c = 0; c < w; ++c) m[c] = scale;  // p == 0: every bit is 1, skip Philox
      } else {
        dropout_factors64(m, c0, r, scale);
      }
      if constexpr (kAdd) {
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) o[c0 + c] = std::fma(xr[c0 + c], m[c], br[c0 + c]);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) o[c0 + c] = xr[c0 + c] * m[c];
      }
    }
  }
}

}  // namespace

template <typename T>
void dropout_forward(T* y_SBC, const T* x_SBC, double p, uint64_t key,
                     const DropoutCounters* counters, int64_t S, int64_t B, int64_t C, int64_t s0) {
  dropout_rows<T, false>(y_SBC, nullptr, x_SBC, p, key, counters, S, B, C, s0, "dropout");
}

template <typename T>
void dropout_add_forward(T* y_SBC, const T* residual_SBC, const T* x_SBC, double p, uint64_t key,
                         const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                         int64_t s0) {
  dropout_rows<T, true>(y_SBC, residual_SBC, x_SBC, p, key, counters, S, B, C, s0, "dropout_add");
}

template <typename T>
void dropout_backward(T* dx_SBC, const T* dy_SBC, double p, uint64_t key,
                      const DropoutCounters* counters, int64_t S, int64_t B, int64_t C,
                      int64_t s0) {
  dropout_rows<T, false>(dx_SBC, nullptr, dy_SBC, p, key, counters, S, B, C, s0,
                         "dropout_backward");
}

#define MOECORE_INSTANTIATE_DROPOUT(T)                                                      \
  template void dropout_forward<T>(T*, const T*, double, uint64_t, const DropoutCounters*,  \
                                   int64_t, int64_t, int64_t, int64_t);                     \
  template void dropout_add_forward<T>(T*, const T*, const T*, double, uint64_t,            \
                                       const DropoutCounters*, int64_t, int64_t, int64_t,   \
                                       int64_t);                                            \
  template void dropout_backward<T>(T*, const T*, double, uint64_t, const DropoutCounters*, \
                                    int64_t, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE_DROPOUT(float)
MOECORE_INSTANTIATE_DROPOUT(double)
#undef MOECORE_INSTANTIATE_DROPOUT

}  // namespace cpu
}  // namespace moecore::ops
