// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, statistics in the working precision (>= f32).
#pragma once

#include <cstdint>

#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void rmsnorm_forward(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok, int64_t H,
                     double eps);
void rmsnorm_forward_bf16w(float* y_TH, float* rstd_T, const float* x_TH, const float* w_H,
                           int64_t n_tok, int64_t H, double eps);
template <typename T>
void rmsnorm_backward(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                      const T* rstd_T, int64_t n_tok, int64_t H);
}  // namespace cpu

// x, y [T, H]; w [H]; rstd [T] saved for backward.
template <typename T>
void rmsnorm_forward(const Exec& ex, T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok,
                     int64_t H, double eps) {
  if (ex.on_cpu()) return cpu::rmsnorm_forward(y_TH, rstd_T, x_TH, w_H, n_tok, H, eps);
  no_kernel(ex, "rmsnorm_forward");
}
template <typename T>
void rmsnorm_forward_ref(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok, int64_t H,
                         double eps);
// The same with y rounded to bf16 values kept in f32 (--bf16 on the widened GEMM path, where
// y feeds only bf16 GEMMs): bitwise round_f32_to_bf16 of rmsnorm_forward's y, in one pass.
inline void rmsnorm_forward_bf16w(const Exec& ex, float* y_TH, float* rstd_T, const float* x_TH,
                                  const float* w_H, int64_t n_tok, int64_t H, double eps) {
  if (ex.on_cpu()) return cpu::rmsnorm_forward_bf16w(y_TH, rstd_T, x_TH, w_H, n_tok, H, eps);
  no_kernel(ex, "rmsnorm_forward_bf16w");
}
// dx = (assigned); dw += (accumulated).
template <typename T>
void rmsnorm_backward(const Exec& ex, T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH,
                      const T* w_H, const T* rstd_T, int64_t n_tok, int64_t H) {
  if (ex.on_cpu()) return cpu::rmsnorm_backward(dx_TH, dw_H, dy_TH, x_TH, w_H, rstd_T, n_tok, H);
  no_kernel(ex, "rmsnorm_backward");
}
template <typename T>
void rmsnorm_backward_ref(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                          const T* rstd_T, int64_t n_tok, int64_t H);

}  // namespace moecore::ops
