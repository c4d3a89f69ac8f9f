// Sigmoid gate: OpenMP over rows. The gate is one exp per row (std::exp: the forward and the
// backward compute the same bits from the same logit), and the backward's dot product runs in
// index order, so no vector width or thread count changes a result.
#include <cmath>

#include "core/check.h"
#include "ops/sigmoid_gate.h"

namespace moecore::ops::cpu {
namespace {
constexpr int64_t kParallelMin = int64_t{1} << 14;

template <typename T>
T sigmoid(T l) {
  return T(1) / (T(1) + std::exp(-l));
}
}  // namespace

template <typename T>
void sigmoid_gate_forward(T* y_NH, const T* s_NH, const T* l_N, int64_t N, int64_t H) {
  MOE_CHECK(N >= 0 && H >= 0, "[sigmoid_gate] negative shape N={} H={}", N, H);
#pragma omp parallel for schedule(static) if (N * H >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const T g = sigmoid(l_N[n]);
    const T* s = s_NH + n * H;
    T* y = y_NH + n * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) y[h] += g * s[h];
  }
}

template <typename T>
void sigmoid_gate_backward(T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH, const T* l_N,
                           int64_t N, int64_t H) {
  MOE_CHECK(N >= 0 && H >= 0, "[sigmoid_gate] negative shape N={} H={}", N, H);
#pragma omp parallel for schedule(static) if (N * H >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const T g = sigmoid(l_N[n]);
    const T* dy = dy_NH + n * H;
    const T* s = s_NH + n * H;
    T dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += dy[h] * s[h];  // in order: no reassociation
    dl_N[n] = g * (T(1) - g) * dot;
    T* ds = ds_NH + n * H;  // may alias dy: the row was read above
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) ds[h] = g * dy[h];
  }
}

template void sigmoid_gate_forward<float>(float*, const float*, const float*, int64_t, int64_t);
template void sigmoid_gate_forward<double>(double*, const double*, const double*, int64_t, int64_t);
template void sigmoid_gate_backward<float>(float*, float*, const float*, const float*, const float*,
                                           int64_t, int64_t);
template void sigmoid_gate_backward<double>(double*, double*, const double*, const double*,
                                            const double*, int64_t, int64_t);

}  // namespace moecore::ops::cpu
