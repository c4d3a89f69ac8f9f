// Fast GEMM on CPU: oneDNN's dnnl_sgemm for f32 (the measured winner, bench/RESULTS.md "BLAS
// choice"), the reference loops for f64 (used only on tiny shapes by gradient checks). Grouped
// GEMM runs one BLAS call per non-empty group, groups in parallel when that pays; linear_* are
// thin layers over gemm.
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/cpu/grouped.h"
#include "ops/gemm.h"

namespace moecore::ops::cpu {
namespace {

// dnnl_sgemm rejects (and a loop would overrun with) a leading dimension shorter than a row.
void check_gemm_args(const char* who, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     int64_t lda, int64_t ldb, int64_t ldc) {
  MOE_CHECK(M >= 0 && N >= 0 && K >= 0, "[{}] negative size M={} N={} K={}", who, M, N, K);
  int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  MOE_CHECK(lda >= std::max<int64_t>(1, a_cols),
            "[{}] lda={} < {} (columns of A as stored, trans_a={}, M={} K={}): pass the row "
            "stride of A",
            who, lda, a_cols, trans_a, M, K);
  MOE_CHECK(ldb >= std::max<int64_t>(1, b_cols),
            "[{}] ldb={} < {} (columns of B as stored, trans_b={}, K={} N={}): pass the row "
            "stride of B",
            who, ldb, b_cols, trans_b, K, N);
  MOE_CHECK(ldc >= std::max<int64_t>(1, N), "[{}] ldc={} < N={}: pass the row stride of C", who,
            ldc, N);
}

// K == 0: op(A)*op(B) is the zero matrix, so C = beta*C; BLAS implementations disagree on
// whether they touch C at all in that case, so we do it ourselves.
template <typename T>
void scale_c(int64_t M, int64_t N, T beta, T* C, int64_t ldc) {
  if (beta == T(1)) return;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
  }
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                ldb, beta, C, ldc);
  MOE_CHECK(st == dnnl_success,
            "[gemm] dnnl_sgemm failed with status {} (M={} N={} K={} lda={} ldb={} ldc={} "
            "trans_a={} trans_b={}): check the oneDNN install (libdnnl) and the leading dims",
            static_cast<int>(st), M, N, K, lda, ldb, ldc, trans_a, trans_b);
}

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  ScopedPhase phase(Phase::Gemm);
  check_gemm_args("gemm", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    // f64 only serves fp64 gradient checks on tiny shapes: the loops are fast enough and exact.
    gemm_ref<T>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

template <typename T>
void linear_forward(T* y_MN, const T* x_MK, const T* w_NK, int64_t M, int64_t N, int64_t K,
                    bool accumulate) {
  gemm<T>(false, true, M, N, K, T(1), x_MK, std::max<int64_t>(1, K), w_NK, std::max<int64_t>(1, K),
          accumulate ? T(1) : T(0), y_MN, std::max<int64_t>(1, N));
}

template <typename T>
void linear_backward(T* dx_MK, T* dw_NK, const T* dy_MN, const T* x_MK, const T* w_NK, int64_t M,
                     int64_t N, int64_t K, bool accumulate_dx) {
  int64_t ld_k = std::max<int64_t>(1, K), ld_n = std::max<int64_t>(1, N);
  // A null dx lets the first layer (whose input needs no gradient) skip the data-grad GEMM.
  if (dx_MK != nullptr) {
    gemm<T>(false, false, M, K, N, T(1), dy_MN, ld_n, w_NK, ld_k, accumulate_dx ? T(1) : T(0),
            dx_MK, ld_k);
  }
  gemm<T>(true, false, N, K, M, T(1), dy_MN, ld_n, x_MK, ld_k, T(1), dw_NK, ld_k);
}

template <typename T>
void grouped_gemm(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* x, const T* w,
                  bool trans_w, T* y) {
  ScopedPhase phase(Phase::Gemm);
  detail::check_group_sizes("grouped_gemm", m_G, G, N, K);
  // f64 (gradient checks on tiny shapes) stays serial: nothing to gain, one less code path.
  bool parallel = std::is_same_v<T, float> && detail::groups_in_parallel(m_G, G);
  const int64_t ld_k = std::max<int64_t>(1, K), ld_n = std::max<int64_t>(1, N);
  detail::for_each_group(m_G, G, parallel, [&](int64_t g, int64_t row0) {
    gemm<T>(false, trans_w, m_G[g], N, K, T(1), x + row0 * K, ld_k, w + g * N * K,
            trans_w ? ld_k : ld_n, T(0), y + row0 * N, ld_n);
  });
}

template <typename T>
void grouped_gemm_wgrad(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* dy,
                        const T* x, T* dw) {
  ScopedPhase phase(Phase::Gemm);
  detail::check_group_sizes("grouped_gemm_wgrad", m_G, G, N, K);
  bool parallel = std::is_same_v<T, float> && detail::groups_in_parallel(m_G, G);
  const int64_t ld_k = std::max<int64_t>(1, K), ld_n = std::max<int64_t>(1, N);
  // An expert that got no tokens is skipped: its dw_g += 0.
  detail::for_each_group(m_G, G, parallel, [&](int64_t g, int64_t row0) {
    gemm<T>(true, false, N, K, m_G[g], T(1), dy + row0 * N, ld_n, x + row0 * K, ld_k, T(1),
            dw + g * N * K, ld_k);
  });
}

#define MOECORE_INSTANTIATE_GEMM(T)                                                            \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, \
                        int64_t, T, T*, int64_t);                                              \
  template void linear_forward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, bool);    \
  template void linear_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t,     \
                                   int64_t, bool);                                             \
  template void grouped_gemm<T>(const int64_t*, int64_t, int64_t, int64_t, const T*, const T*, \
                                bool, T*);                                                     \
  template void grouped_gemm_wgrad<T>(const int64_t*, int64_t, int64_t, int64_t, const T*,     \
                                      const T*, T*);
MOECORE_INSTANTIATE_GEMM(float)
MOECORE_INSTANTIATE_GEMM(double)
#undef MOECORE_INSTANTIATE_GEMM

}  // namespace moecore::ops::cpu
