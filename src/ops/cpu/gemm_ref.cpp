// Plain-loop GEMM and grouped GEMM: the oracle every fast path is tested against, and the f64
// path (tiny shapes in gradient checks). Accumulates in double so its own rounding is far
// below the f32 tolerances it is used to judge.
#include <cstdint>

#include "core/check.h"
#include "ops/gemm.h"

namespace moecore::ops {

template <typename T>
void gemm_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
              int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  MOE_CHECK(M >= 0 && N >= 0 && K >= 0, "[gemm_ref] negative size M={} N={} K={}", M, N, K);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        double a = static_cast<double>(trans_a ? A[k * lda + i] : A[i * lda + k]);
        double b = static_cast<double>(trans_b ? B[j * ldb + k] : B[k * ldb + j]);
        acc += a * b;
      }
      // BLAS convention: beta == 0 means C is not read, so garbage (even NaN) in C is ignored.
      double c =
          beta == T(0) ? 0.0 : static_cast<double>(beta) * static_cast<double>(C[i * ldc + j]);
      C[i * ldc + j] = static_cast<T>(static_cast<double>(alpha) * acc + c);
    }
  }
}

template <typename T>
void grouped_gemm_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* x, const T* w,
                      bool trans_w, T* y) {
  MOE_CHECK(G >= 0 && N >= 0 && K >= 0, "[grouped_gemm_ref] negative size G={} N={} K={}", G, N, K);
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t m = m_G[g];
    MOE_CHECK(m >= 0, "[grouped_gemm_ref] group {} has {} rows: counts must be >= 0", g, m);
    const T* x_g = x + row0 * K;
    const T* w_g = w + g * N * K;
    T* y_g = y + row0 * N;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          double wv = static_cast<double>(trans_w ? w_g[j * K + k] : w_g[k * N + j]);
          acc += static_cast<double>(x_g[i * K + k]) * wv;
        }
        y_g[i * N + j] = static_cast<T>(acc);
      }
    }
    row0 += m;
  }
}

template <typename T>
void grouped_gemm_wgrad_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* dy,
                            const T* x, T* dw) {
  MOE_CHECK(G >= 0 && N >= 0 && K >= 0, "[grouped_gemm_wgrad_ref] negative size G={} N={} K={}", G,
            N, K);
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t m = m_G[g];
    MOE_CHECK(m >= 0, "[grouped_gemm_wgrad_ref] group {} has {} rows: counts must be >= 0", g, m);
    const T* dy_g = dy + row0 * N;
    const T* x_g = x + row0 * K;
    T* dw_g = dw + g * N * K;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        double acc = 0.0;
        for (int64_t i = 0; i < m; ++i) {
          acc += static_cast<double>(dy_g[i * N + n]) * static_cast<double>(x_g[i * K + k]);
        }
        dw_g[n * K + k] = static_cast<T>(static_cast<double>(dw_g[n * K + k]) + acc);
      }
    }
    row0 += m;
  }
}

#define MOECORE_INSTANTIATE_GEMM_REF(T)                                                            \
  template void gemm_ref<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, \
                            int64_t, T, T*, int64_t);                                              \
  template void grouped_gemm_ref<T>(const int64_t*, int64_t, int64_t, int64_t, const T*, const T*, \
                                    bool, T*);                                                     \
  template void grouped_gemm_wgrad_ref<T>(const int64_t*, int64_t, int64_t, int64_t, const T*,     \
                                          const T*, T*);
MOECORE_INSTANTIATE_GEMM_REF(float)
MOECORE_INSTANTIATE_GEMM_REF(double)
#undef MOECORE_INSTANTIATE_GEMM_REF

}  // namespace moecore::ops
