// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, statistics in the working precision (>= f32).
#pragma once

#include <cstdint>

namespace moecore::ops {

// x, y [T, H]; w [H]; rstd [T] saved for backward.
template <typename T>
void rmsnorm_forward(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok, int64_t H,
                     double eps);
template <typename T>
void rmsnorm_forward_ref(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok,
                         int64_t H, double eps);
// The same with y rounded to bf16 values kept in f32 (--bf16 on the widened GEMM path, where
// y feeds only bf16 GEMMs): bitwise round_f32_to_bf16 of rmsnorm_forward's y, in one pass.
void rmsnorm_forward_bf16w(float* y_TH, float* rstd_T, const float* x_TH, const float* w_H,
                           int64_t n_tok, int64_t H, double eps);
// dx = (assigned); dw += (accumulated).
template <typename T>
void rmsnorm_backward(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                      const T* rstd_T, int64_t n_tok, int64_t H);
template <typename T>
void rmsnorm_backward_ref(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                          const T* rstd_T, int64_t n_tok, int64_t H);

}  // namespace moecore::ops
