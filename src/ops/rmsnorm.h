// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, statistics in the working precision (>= f32).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "core/host_device.h"

namespace moecore::ops {

// The row bodies of the CPU fast path and the CUDA kernel (never of the _ref): the row's rstd from
// its sum of squares, and one output element. Neither has a multiply-add to contract, so both
// round the same on every backend; only the sum of squares' order differs.
template <typename T>
MOE_HOST_DEVICE inline T rmsnorm_rstd(T sum_sq, int64_t H, double eps) {
  return T(1) / std::sqrt(sum_sq / T(H) + T(eps));
}
template <typename T>
MOE_HOST_DEVICE inline T rmsnorm_element(T x, T rstd, T w) {
  return x * rstd * w;
}
// The backward's: dx = rstd w dy - x c with c = rstd^3 sum_h(w dy x) / H. (dw's term dy x rstd
// is not shared: as a call it changed GCC's code for the CPU's column-block loop.)
template <typename T>
MOE_HOST_DEVICE inline T rmsnorm_backward_coeff(T rstd, T dot, int64_t H) {
  return rstd * rstd * rstd * dot / T(H);
}
template <typename T>
MOE_HOST_DEVICE inline T rmsnorm_backward_element(T dy, T x, T w, T rstd, T c) {
  return rstd * w * dy - x * c;
}

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
// The CUDA kernels (ops/cuda/: the CUDA build, the emulated CUDA build and the grid emulator's
// tests); `stream` is the context's. The switches below call them where the build has kernels.
namespace cuda {
template <typename T>
void rmsnorm_forward(void* stream, T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok,
                     int64_t H, double eps);
// y rounded to bf16 values in the same pass: bitwise round_f32_to_bf16 of rmsnorm_forward's y.
void rmsnorm_forward_bf16w(void* stream, float* y_TH, float* rstd_T, const float* x_TH,
                           const float* w_H, int64_t n_tok, int64_t H, double eps);
// dx assigned, dw accumulated, as rmsnorm_backward below; dw's sums over the tokens in the fixed
// two-stage tree of ops/cuda/reduce_cols.cuh (set by the shape: the same bits run to run).
template <typename T>
void rmsnorm_backward(void* stream, T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                      const T* rstd_T, int64_t n_tok, int64_t H);
}  // namespace cuda

// x, y [T, H]; w [H]; rstd [T] saved for backward.
template <typename T>
void rmsnorm_forward(const Exec& ex, DevPtr<T> y_TH, DevPtr<T> rstd_T, DevPtr<const T> x_TH,
                     DevPtr<const T> w_H, int64_t n_tok, int64_t H, double eps) {
  if (ex.on_cpu())
    return cpu::rmsnorm_forward(raw_ptr(y_TH), raw_ptr(rstd_T), raw_ptr(x_TH), raw_ptr(w_H), n_tok,
                                H, eps);
  return cuda::rmsnorm_forward(ex.stream, raw_ptr(y_TH), raw_ptr(rstd_T), raw_ptr(x_TH),
                               raw_ptr(w_H), n_tok, H, eps);
}
template <typename T>
void rmsnorm_forward_ref(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok, int64_t H,
                         double eps);
// The same with y rounded to bf16 values kept in f32 (--bf16 on the widened GEMM path, where
// y feeds only bf16 GEMMs): bitwise round_f32_to_bf16 of rmsnorm_forward's y, in one pass.
inline void rmsnorm_forward_bf16w(const Exec& ex, DevPtr<float> y_TH, DevPtr<float> rstd_T,
                                  DevPtr<const float> x_TH, DevPtr<const float> w_H, int64_t n_tok,
                                  int64_t H, double eps) {
  if (ex.on_cpu())
    return cpu::rmsnorm_forward_bf16w(raw_ptr(y_TH), raw_ptr(rstd_T), raw_ptr(x_TH), raw_ptr(w_H),
                                      n_tok, H, eps);
  return cuda::rmsnorm_forward_bf16w(ex.stream, raw_ptr(y_TH), raw_ptr(rstd_T), raw_ptr(x_TH),
                                     raw_ptr(w_H), n_tok, H, eps);
}
// dx = (assigned); dw += (accumulated).
template <typename T>
void rmsnorm_backward(const Exec& ex, DevPtr<T> dx_TH, DevPtr<T> dw_H, DevPtr<const T> dy_TH,
                      DevPtr<const T> x_TH, DevPtr<const T> w_H, DevPtr<const T> rstd_T,
                      int64_t n_tok, int64_t H) {
  if (ex.on_cpu())
    return cpu::rmsnorm_backward(raw_ptr(dx_TH), raw_ptr(dw_H), raw_ptr(dy_TH), raw_ptr(x_TH),
                                 raw_ptr(w_H), raw_ptr(rstd_T), n_tok, H);
  return cuda::rmsnorm_backward(ex.stream, raw_ptr(dx_TH), raw_ptr(dw_H), raw_ptr(dy_TH),
                                raw_ptr(x_TH), raw_ptr(w_H), raw_ptr(rstd_T), n_tok, H);
}
template <typename T>
void rmsnorm_backward_ref(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                          const T* rstd_T, int64_t n_tok, int64_t H);

}  // namespace moecore::ops
