// LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * g + b, with g = w, or g = 1 + w when
// zero_centered (Megatron's --apply-layernorm-1p stores gamma - 1, so weight decay pulls the
// gain towards 1). Statistics in the working precision (>= f32); mean and rstd saved.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void layernorm_forward(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H, const T* b_H,
                       int64_t n_tok, int64_t H, double eps, bool zero_centered);
void layernorm_forward_bf16w(float* y_TH, float* mean_T, float* rstd_T, const float* x_TH,
                             const float* w_H, const float* b_H, int64_t n_tok, int64_t H,
                             double eps, bool zero_centered);
template <typename T>
void layernorm_backward(T* dx_TH, T* dw_H, T* db_H, const T* dy_TH, const T* x_TH, const T* w_H,
                        const T* mean_T, const T* rstd_T, int64_t n_tok, int64_t H,
                        bool zero_centered);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, the emulated CUDA build and the grid emulator's
// tests); `stream` is the context's. The switches below call them where the build has kernels.
namespace cuda {
template <typename T>
void layernorm_forward(void* stream, T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H,
                       const T* b_H, int64_t n_tok, int64_t H, double eps, bool zero_centered);
void layernorm_forward_bf16w(void* stream, float* y_TH, float* mean_T, float* rstd_T,
                             const float* x_TH, const float* w_H, const float* b_H, int64_t n_tok,
                             int64_t H, double eps, bool zero_centered);
// dx assigned, dw and db accumulated, as layernorm_backward below; dw's and db's sums over the
// tokens in the fixed two-stage tree of ops/cuda/reduce_cols.cuh (set by the shape).
template <typename T>
void layernorm_backward(void* stream, T* dx_TH, T* dw_H, T* db_H, const T* dy_TH, const T* x_TH,
                        const T* w_H, const T* mean_T, const T* rstd_T, int64_t n_tok, int64_t H,
                        bool zero_centered);
}  // namespace cuda

// x, y [T, H]; w, b [H]; mean, rstd [T] saved for backward.
template <typename T>
void layernorm_forward(const Exec& ex, DevPtr<T> y_TH, DevPtr<T> mean_T, DevPtr<T> rstd_T,
                       DevPtr<const T> x_TH, DevPtr<const T> w_H, DevPtr<const T> b_H,
                       int64_t n_tok, int64_t H, double eps, bool zero_centered) {
  if (ex.on_cpu())
    return cpu::layernorm_forward(raw_ptr(y_TH), raw_ptr(mean_T), raw_ptr(rstd_T), raw_ptr(x_TH),
                                  raw_ptr(w_H), raw_ptr(b_H), n_tok, H, eps, zero_centered);
  return cuda::layernorm_forward(ex.stream, raw_ptr(y_TH), raw_ptr(mean_T), raw_ptr(rstd_T),
                                 raw_ptr(x_TH), raw_ptr(w_H), raw_ptr(b_H), n_tok, H, eps,
                                 zero_centered);
}
template <typename T>
void layernorm_forward_ref(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H, const T* b_H,
                           int64_t n_tok, int64_t H, double eps, bool zero_centered);
// The same with y rounded to bf16 values kept in f32 (--bf16 on the widened GEMM path, where
// y feeds only bf16 GEMMs): bitwise round_f32_to_bf16 of layernorm_forward's y, in one pass.
inline void layernorm_forward_bf16w(const Exec& ex, DevPtr<float> y_TH, DevPtr<float> mean_T,
                                    DevPtr<float> rstd_T, DevPtr<const float> x_TH,
                                    DevPtr<const float> w_H, DevPtr<const float> b_H, int64_t n_tok,
                                    int64_t H, double eps, bool zero_centered) {
  if (ex.on_cpu())
    return cpu::layernorm_forward_bf16w(raw_ptr(y_TH), raw_ptr(mean_T), raw_ptr(rstd_T),
                                        raw_ptr(x_TH), raw_ptr(w_H), raw_ptr(b_H), n_tok, H, eps,
                                        zero_centered);
  return cuda::layernorm_forward_bf16w(ex.stream, raw_ptr(y_TH), raw_ptr(mean_T), raw_ptr(rstd_T),
                                       raw_ptr(x_TH), raw_ptr(w_H), raw_ptr(b_H), n_tok, H, eps,
                                       zero_centered);
}
// dx = (assigned); dw += , db += (accumulated). zero_centered changes the gain (1 + w), not dw.
template <typename T>
void layernorm_backward(const Exec& ex, DevPtr<T> dx_TH, DevPtr<T> dw_H, DevPtr<T> db_H,
                        DevPtr<const T> dy_TH, DevPtr<const T> x_TH, DevPtr<const T> w_H,
                        DevPtr<const T> mean_T, DevPtr<const T> rstd_T, int64_t n_tok, int64_t H,
                        bool zero_centered) {
  if (ex.on_cpu())
    return cpu::layernorm_backward(raw_ptr(dx_TH), raw_ptr(dw_H), raw_ptr(db_H), raw_ptr(dy_TH),
                                   raw_ptr(x_TH), raw_ptr(w_H), raw_ptr(mean_T), raw_ptr(rstd_T),
                                   n_tok, H, zero_centered);
  return cuda::layernorm_backward(ex.stream, raw_ptr(dx_TH), raw_ptr(dw_H), raw_ptr(db_H),
                                  raw_ptr(dy_TH), raw_ptr(x_TH), raw_ptr(w_H), raw_ptr(mean_T),
                                  raw_ptr(rstd_T), n_tok, H, zero_centered);
}
template <typename T>
void layernorm_backward_ref(T* dx_TH, T* dw_H, T* db_H, const T* dy_TH, const T* x_TH, const T* w_H,
                            const T* mean_T, const T* rstd_T, int64_t n_tok, int64_t H,
                            bool zero_centered);

}  // namespace moecore::ops
