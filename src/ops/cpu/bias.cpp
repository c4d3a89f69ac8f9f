// Column bias: the forward over rows (OpenMP), the backward over columns (each thread sums its
// columns over the rows in order). The grouped form the same way, group after group.
#include "ops/bias.h"
#include "core/check.h"
#include "ops/cpu/grouped.h"

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

template <typename T>
void grouped_bias_forward(T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G, int64_t G,
                          int64_t C) {
  detail::check_group_sizes("grouped_bias_forward", m_G, G, C, 0);
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = m_G[g];
    const T* b = b_GC + g * C;
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
    for (int64_t n = row0; n < row0 + rows; ++n) {
      T* y = y_NC + n * C;
      if (p_N == nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) y[c] += b[c];
      } else {
        const T s = p_N[n];
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) y[c] += s * b[c];
      }
    }
    row0 += rows;
  }
}

template <typename T>
void grouped_bias_backward(T* db_GC, T* dp_N, const T* dy_NC, const T* b_GC, const T* p_N,
                           const int64_t* m_G, int64_t G, int64_t C) {
  detail::check_group_sizes("grouped_bias_backward", m_G, G, C, 0);
  const bool want_dp = p_N != nullptr && dp_N != nullptr;
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = m_G[g];
    const T* dy = dy_NC + row0 * C;
    const bool parallel = rows * C >= kParallelMin;
    // db: threads own columns; each column's rows in order.
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t c = 0; c < C; ++c) {
      T acc = 0;
      if (p_N == nullptr) {
        for (int64_t n = 0; n < rows; ++n) acc += dy[n * C + c];
      } else {
        for (int64_t n = 0; n < rows; ++n) acc += p_N[row0 + n] * dy[n * C + c];
      }
      db_GC[g * C + c] += acc;
    }
    if (want_dp) {
      // dp: threads own rows; each row's columns in order (no simd reduction: one association).
      const T* b = b_GC + g * C;
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t n = 0; n < rows; ++n) {
        T acc = 0;
        for (int64_t c = 0; c < C; ++c) acc += dy[n * C + c] * b[c];
        dp_N[row0 + n] += acc;
      }
    }
    row0 += rows;
  }
}

template void bias_forward<float>(float*, const float*, int64_t, int64_t);
template void bias_forward<double>(double*, const double*, int64_t, int64_t);
template void bias_backward<float>(float*, const float*, int64_t, int64_t);
template void bias_backward<double>(double*, const double*, int64_t, int64_t);
template void grouped_bias_forward<float>(float*, const float*, const float*, const int64_t*,
                                          int64_t, int64_t);
template void grouped_bias_forward<double>(double*, const double*, const double*, const int64_t*,
                                           int64_t, int64_t);
template void grouped_bias_backward<float>(float*, float*, const float*, const float*,
                                           const float*, const int64_t*, int64_t, int64_t);
template void grouped_bias_backward<double>(double*, double*, const double*, const double*,
                                            const double*, const int64_t*, int64_t, int64_t);

}  // namespace moecore::ops::cpu
