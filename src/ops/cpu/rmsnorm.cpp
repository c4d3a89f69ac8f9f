// RMSNorm fast path: OpenMP over tokens, vectorisable inner loops in the working precision.
// dw is reduced without atomics or per-thread buffers: threads own column blocks of dw and visit
// tokens in order, so the result is bitwise reproducible for any thread count.
#include <algorithm>
#include <bit>
#include <cmath>

#include "ops/cast.h"
#include "ops/rmsnorm.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
// Columns per dw block: a multiple of the vector width, small enough to spread over threads.
constexpr int64_t kColBlock = 64;
}  // namespace

namespace {
// kRound: y rounded to bf16 values (f32 only), in the same pass.
template <typename T, bool kRound>
void rmsnorm_forward_loop(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok, int64_t H,
                          double eps) {
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    T* y = y_TH + t * H;
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t h = 0; h < H; ++h) ss += x[h] * x[h];
    const T rstd = rmsnorm_rstd(ss, H, eps);
    rstd_T[t] = rstd;
    if constexpr (kRound) {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        y[h] = f32_bf16_rounded(rmsnorm_element(x[h], rstd, w_H[h]));
      }
    } else {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) y[h] = rmsnorm_element(x[h], rstd, w_H[h]);
    }
  }
}
}  // namespace

template <typename T>
void rmsnorm_forward(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok, int64_t H,
                     double eps) {
  rmsnorm_forward_loop<T, false>(y_TH, rstd_T, x_TH, w_H, n_tok, H, eps);
}

void rmsnorm_forward_bf16w(float* y_TH, float* rstd_T, const float* x_TH, const float* w_H,
                           int64_t n_tok, int64_t H, double eps) {
  rmsnorm_forward_loop<float, true>(y_TH, rstd_T, x_TH, w_H, n_tok, H, eps);
}

template <typename T>
void rmsnorm_backward(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                      const T* rstd_T, int64_t n_tok, int64_t H) {
  const bool par = n_tok * H >= kParallelMin;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    const T* dy = dy_TH + t * H;
    T* dx = dx_TH + t * H;
    const T rstd = rstd_T[t];
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t h = 0; h < H; ++h) dot += w_H[h] * dy[h] * x[h];
    const T c = rmsnorm_backward_coeff(rstd, dot, H);
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dx[h] = rmsnorm_backward_element(dy[h], x[h], w_H[h], rstd, c);
  }
  const int64_t n_blocks = (H + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t h0 = b * kColBlock, h1 = std::min(H, h0 + kColBlock);
    T acc[kColBlock] = {};
    for (int64_t t = 0; t < n_tok; ++t) {
      const T* x = x_TH + t * H;
      const T* dy = dy_TH + t * H;
      const T rstd = rstd_T[t];
#pragma omp simd
      for (int64_t h = h0; h < h1; ++h) acc[h - h0] += dy[h] * x[h] * rstd;
    }
    for (int64_t h = h0; h < h1; ++h) dw_H[h] += acc[h - h0];
  }
}

template void rmsnorm_forward<float>(float*, float*, const float*, const float*, int64_t, int64_t,
                                     double);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, int64_t,
                                      int64_t, double);
template void rmsnorm_backward<float>(float*, float*, const float*, const float*, const float*,
                                      const float*, int64_t, int64_t);
template void rmsnorm_backward<double>(double*, double*, const double*, const double*,
                                       const double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cpu
