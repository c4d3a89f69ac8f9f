// GEMM and grouped GEMM. Row-major. `*_ref` are plain loops (the oracle); the unsuffixed
// functions take the execution context and switch to its backend: on the CPU the fast path
// (oneDNN sgemm for f32; loops for f64, which only reference computations and gradient checks
// use).
#pragma once

#include <cstdint>
#include <vector>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/memory.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
template <typename T>
void linear_forward(T* y_MN, const T* x_MK, const T* w_NK, int64_t M, int64_t N, int64_t K,
                    bool accumulate = false);
template <typename T>
void linear_backward(T* dx_MK, T* dw_NK, const T* dy_MN, const T* x_MK, const T* w_NK, int64_t M,
                     int64_t N, int64_t K, bool accumulate_dx = false);
template <typename T>
void grouped_gemm(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* x, const T* w,
                  bool trans_w, T* y);
template <typename T>
void grouped_gemm_wgrad(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* dy,
                        const T* x, T* dw);
}  // namespace cpu
// The CUDA paths (ops/cuda/gemm.cu): cuBLASLt matmuls (ops/cuda/blas.h), f32 with TF32 off
// (unless --fp32-matmul-precision high: ops/f32_matmul_precision.h), f64 in f64. The grouped GEMMs call cublasGemmGroupedBatchedEx, whose group sizes are host arrays:
// their switches read m_G on the host (grouped_gemm_host_sizes: ops::read_back, a wait for the
// stream), the documented sync point kGroupedGemmSizes (docs/design.md, "The execution model"),
// and the library's problem tables are built on the host, so a step with a grouped GEMM on CUDA
// is not capturable. The cuda:: grouped forms take those host sizes (m_G_host). Experts with no
// rows make no problem. When every group has the same rows and the caller knows how many on the
// host (rows_per_group > 0: the dense MLP's one group of tokens, padded dispatch's capacity
// blocks), the CUDA path is one strided-batched matmul (desc::padded_grouped_*_call) that reads
// no size: no sync, capturable in a CUDA graph (core/stream_graph.h). The CPU path reads m_G.
inline constexpr const char* kGroupedGemmSizes =
    "grouped GEMM group sizes read on the host (cublasGemmGroupedBatchedEx takes host arrays)";
// m_G [G] of the context's memory in host memory, inside the sync point kGroupedGemmSizes (empty
// for G <= 0: the callee checks G). Part of the grouped GEMMs' switches, not an op of its own (the
// ops take the context first; the backend harness lists them so).
inline std::vector<int64_t> grouped_gemm_host_sizes(DevPtr<const int64_t> m_G, int64_t G,
                                                    const Exec& ex) {
  std::vector<int64_t> sizes;
  if (G <= 0) return sizes;
  {
    // The sync point's host copy of the sizes: not counted by the audit, as the grouped call's
    // host tables are not (ops/cuda/gemm.cu).
    const SyncAudit::Paused host_copy;
    sizes.resize(static_cast<size_t>(G));
  }
  SyncAudit::Point point(kGroupedGemmSizes);
  read_back(ex, sizes.data(), m_G, G);
  return sizes;
}
namespace cuda {
template <typename T>
void gemm(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
template <typename T>
void linear_forward(const Exec& ex, T* y_MN, const T* x_MK, const T* w_NK, int64_t M, int64_t N,
                    int64_t K, bool accumulate);
template <typename T>
void linear_backward(const Exec& ex, T* dx_MK, T* dw_NK, const T* dy_MN, const T* x_MK,
                     const T* w_NK, int64_t M, int64_t N, int64_t K, bool accumulate_dx);
template <typename T>
void grouped_gemm(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                  const T* x, const T* w, bool trans_w, T* y);
template <typename T>
void grouped_gemm_wgrad(const Exec& ex, const int64_t* m_G_host, int64_t G, int64_t N, int64_t K,
                        const T* dy, const T* x, T* dw);
// Every group `rows` rows (> 0): one strided-batched matmul, no sizes read.
template <typename T>
void grouped_gemm(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K, const T* x,
                        const T* w, bool trans_w, T* y);
template <typename T>
void grouped_gemm_wgrad(const Exec& ex, int64_t rows, int64_t G, int64_t N, int64_t K,
                              const T* dy, const T* x, T* dw);
}  // namespace cuda

// C[M,N] = alpha * op(A) * op(B) + beta * C, op(A) is [M,K], op(B) is [K,N].
// lda/ldb/ldc are the row strides of A, B, C as stored (before op).
template <typename T>
void gemm(const Exec& ex, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          DevPtr<const T> A, int64_t lda, DevPtr<const T> B, int64_t ldb, T beta, DevPtr<T> C,
          int64_t ldc) {
  if (ex.on_cpu())
    return cpu::gemm(trans_a, trans_b, M, N, K, alpha, raw_ptr(A), lda, raw_ptr(B), ldb, beta,
                     raw_ptr(C), ldc);
  return cuda::gemm(ex, trans_a, trans_b, M, N, K, alpha, raw_ptr(A), lda, raw_ptr(B), ldb, beta,
                    raw_ptr(C), ldc);
}
template <typename T>
void gemm_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
              int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Convenience for contiguous operands: y[M,N] (+)= x[M,K] * w^T with w [N,K]  (a "linear").
template <typename T>
void linear_forward(const Exec& ex, DevPtr<T> y_MN, DevPtr<const T> x_MK, DevPtr<const T> w_NK,
                    int64_t M, int64_t N, int64_t K, bool accumulate = false) {
  if (ex.on_cpu())
    return cpu::linear_forward(raw_ptr(y_MN), raw_ptr(x_MK), raw_ptr(w_NK), M, N, K, accumulate);
  return cuda::linear_forward(ex, raw_ptr(y_MN), raw_ptr(x_MK), raw_ptr(w_NK), M, N, K,
                              accumulate);
}
// dx[M,K] (+)= dy[M,N] * w[N,K];  dw[N,K] += dy^T * x  (dw always accumulates). dx may be
// null (a first layer needs no input gradient).
template <typename T>
void linear_backward(const Exec& ex, DevPtr<T> dx_MK, DevPtr<T> dw_NK, DevPtr<const T> dy_MN,
                     DevPtr<const T> x_MK, DevPtr<const T> w_NK, int64_t M, int64_t N, int64_t K,
                     bool accumulate_dx = false) {
  if (ex.on_cpu())
    return cpu::linear_backward(raw_ptr(dx_MK), raw_ptr(dw_NK), raw_ptr(dy_MN), raw_ptr(x_MK),
                                raw_ptr(w_NK), M, N, K, accumulate_dx);
  return cuda::linear_backward(ex, raw_ptr(dx_MK), raw_ptr(dw_NK), raw_ptr(dy_MN), raw_ptr(x_MK),
                               raw_ptr(w_NK), M, N, K, accumulate_dx);
}

// Grouped GEMM over G groups (local experts), one call, zero-row groups allowed.
// x is stacked by rows: group g owns rows [sum_{h<g} m_G[h], + m_G[g]).
// Forward:  y_g[m_g, N] = x_g[m_g, K] * op(w_g),  w is [G, N, K] if trans_w else [G, K, N].
// rows_per_group > 0: every m_g equals it (the caller knows it on the host); see above.
template <typename T>
void grouped_gemm(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N, int64_t K,
                  DevPtr<const T> x, DevPtr<const T> w, bool trans_w, DevPtr<T> y,
                  int64_t rows_per_group = 0) {
  if (ex.on_cpu())
    return cpu::grouped_gemm(raw_ptr(m_G), G, N, K, raw_ptr(x), raw_ptr(w), trans_w, raw_ptr(y));
  if (rows_per_group > 0) {
    return cuda::grouped_gemm(ex, rows_per_group, G, N, K, raw_ptr(x), raw_ptr(w), trans_w,
                                    raw_ptr(y));
  }
  const std::vector<int64_t> sizes = grouped_gemm_host_sizes(m_G, G, ex);
  return cuda::grouped_gemm(ex, sizes.data(), G, N, K, raw_ptr(x), raw_ptr(w), trans_w,
                            raw_ptr(y));
}
template <typename T>
void grouped_gemm_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* x, const T* w,
                      bool trans_w, T* y);
// Weight gradient: dw_g[N, K] += dy_g[m_g, N]^T * x_g[m_g, K]  (dw is [G, N, K], accumulated).
template <typename T>
void grouped_gemm_wgrad(const Exec& ex, DevPtr<const int64_t> m_G, int64_t G, int64_t N, int64_t K,
                        DevPtr<const T> dy, DevPtr<const T> x, DevPtr<T> dw,
                        int64_t rows_per_group = 0) {
  if (ex.on_cpu())
    return cpu::grouped_gemm_wgrad(raw_ptr(m_G), G, N, K, raw_ptr(dy), raw_ptr(x), raw_ptr(dw));
  if (rows_per_group > 0) {
    return cuda::grouped_gemm_wgrad(ex, rows_per_group, G, N, K, raw_ptr(dy), raw_ptr(x),
                                          raw_ptr(dw));
  }
  const std::vector<int64_t> sizes = grouped_gemm_host_sizes(m_G, G, ex);
  return cuda::grouped_gemm_wgrad(ex, sizes.data(), G, N, K, raw_ptr(dy), raw_ptr(x),
                                  raw_ptr(dw));
}
template <typename T>
void grouped_gemm_wgrad_ref(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const T* dy,
                            const T* x, T* dw);

}  // namespace moecore::ops
