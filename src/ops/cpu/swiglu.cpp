// SwiGLU fast path: OpenMP over rows, vectorisable per-row loops in the working precision.
// Each row is independent, so results do not depend on the thread count.
#include <cmath>

#include "ops/cpu/fast_exp.h"
#include "ops/swiglu.h"

namespace moecore::ops {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

template <typename T>
void swiglu_forward(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = h_N2F + n * 2 * F;
    const T* u = g + F;
    T* a = a_NF + n * F;
    const T p = p_N ? p_N[n] : T(1);
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) a[f] = g[f] / (T(1) + fast_exp(-g[f])) * u[f] * p;
  }
}

template <typename T>
void swiglu_backward(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N, int64_t N,
                     int64_t F) {
  const bool want_dp = p_N && dp_N;
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = h_N2F + n * 2 * F;
    const T* u = g + F;
    const T* da = da_NF + n * F;
    T* dg = dh_N2F + n * 2 * F;
    T* du = dg + F;
    const T p = p_N ? p_N[n] : T(1);
    T dp = 0;
#pragma omp simd reduction(+ : dp)
    for (int64_t f = 0; f < F; ++f) {
      const T s = T(1) / (T(1) + fast_exp(-g[f]));
      const T silu = g[f] * s;
      dg[f] = da[f] * p * u[f] * s * (T(1) + g[f] * (T(1) - s));
      du[f] = da[f] * p * silu;
      dp += silu * u[f] * da[f];
    }
    if (want_dp) dp_N[n] = dp;
  }
}

template void swiglu_forward<float>(float*, const float*, const float*, int64_t, int64_t);
template void swiglu_forward<double>(double*, const double*, const double*, int64_t, int64_t);
template void swiglu_backward<float>(float*, float*, const float*, const float*, const float*,
                                     int64_t, int64_t);
template void swiglu_backward<double>(double*, double*, const double*, const double*,
                                      const double*, int64_t, int64_t);

}  // namespace moecore::ops
