// bf16 GEMM with f32 accumulation and output, for --bf16 mixed precision: the inputs are bf16
// (weights: the bf16 copies of the fp32 master weights; activations: cast on the way in), the
// product accumulates in f32 (oneDNN's AVX512-BF16 kernels, about 2x the fp32 rate here).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace moecore::ops {

// C[M,N] = op(A) op(B) + beta * C (beta 0 or 1), row-major with row strides lda/ldb/ldc.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
               int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm_bf16_ref(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                   int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The bf16 "linear": y[M,N] = bf16(x)[M,K] * w^T, w [N,K] bf16; x16 is workspace of M*K.
void linear_forward_bf16(float* y_MN, const float* x_MK, const bf16* w_NK, int64_t M, int64_t N,
                         int64_t K, bf16* x16);
// dx[M,K] = bf16(dy) * w (dx may be null); dw[N,K] += bf16(dy)^T * bf16(x) in f32.
// dy16 and x16 are workspace of M*N and M*K.
void linear_backward_bf16(float* dx_MK, float* dw_NK, const float* dy_MN, const float* x_MK,
                          const bf16* w_NK, int64_t M, int64_t N, int64_t K, bf16* dy16, bf16* x16);

// Grouped (per local expert) versions over rows stacked by group, as grouped_gemm in gemm.h,
// on inputs already cast to bf16 (the caller casts each activation once and reuses it):
//   y_g = x16_g * op(w_g),  w [G, N, K] (trans_w) or [G, K, N].
void grouped_gemm_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* x16,
                       const bf16* w, bool trans_w, float* y);
//   dw_g[N, K] += dy16_g^T * x16_g (f32 accumulate).
void grouped_gemm_wgrad_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* dy16,
                             const bf16* x16, float* dw);

}  // namespace moecore::ops
