// Column bias: the forward over rows (OpenMP), the backward over columns (each thread sums its
// columns over the rows in order).
#include "ops/bias.h"
#include "core/check.h"

namespace moecore::ops::cpu {
namespace {
constexpr int64_t kParallelMin = int64_t{1} << 14;
}  // namespace

template <typename T>
void bias_forward(T* y_MN, const T* b_N, int64_t M, int64_t N) {
  MOE_CHECK(M >= 0 && N >= 0, "[bias] negative shape M={} N={}", M, N);
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
  for (int64_t m = 0; m < M; ++m) {
    T* y = y_MN + m * N;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) y[n] += b_N[n];
  }
}

template <typename T>
void bias_backward(T* db_N, const T* dy_MN, int64_t M, int64_t N) {
  MOE_CHECK(M >= 0 && N >= 0, "[bias] negative shape M={} N={}", M, N);
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    T acc = 0;
    for (int64_t m = 0; m < M; ++m) acc += dy_MN[m * N + n];
    db_N[n] += acc;
  }
}

template void bias_forward<float>(float*, const float*, int64_t, int64_t);
template void bias_forward<double>(double*, const double*, int64_t, int64_t);
template void bias_backward<float>(float*, const float*, int64_t, int64_t);
template void bias_backward<double>(double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cpu
