// LayerNorm fast path: OpenMP over tokens, vectorisable inner loops in the working precision.
// dw and db are reduced without atomics or per-thread buffers: threads own column blocks and
// visit tokens in order, so the result is bitwise reproducible for any thread count.
#include <algorithm>
#include <cmath>

#include "ops/cast.h"
#include "ops/layernorm.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
// Columns per dw / db block: a multiple of the vector width, small enough to spread over threads.
constexpr int64_t kColBlock = 64;

// The gain applied to xhat: w, or 1 + w for the zero-centred (layernorm-1p) weight.
template <typename T, bool kZeroCentered>
inline T gain(T w) {
  if constexpr (kZeroCentered) {
    return T(1) + w;
  } else {
    return w;
  }
}

// kRound: y rounded to bf16 values (f32 only), in the same pass. The mean is subtracted before
// squaring (two passes over the row): one pass of sum(x^2) - mean^2 cancels when |mean| >> std.
template <typename T, bool kZeroCentered, bool kRound>
void layernorm_forward_loop(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H,
                            const T* b_H, int64_t n_tok, int64_t H, double eps) {
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    T* y = y_TH + t * H;
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t h = 0; h < H; ++h) sum += x[h];
    const T mean = sum / T(H);
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t h = 0; h < H; ++h) ss += (x[h] - mean) * (x[h] - mean);
    const T rstd = T(1) / std::sqrt(ss / T(H) + T(eps));
    mean_T[t] = mean;
    rstd_T[t] = rstd;
    if constexpr (kRound) {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        y[h] = f32_bf16_rounded((x[h] - mean) * rstd * gain<T, kZeroCentered>(w_H[h]) + b_H[h]);
      }
    } else {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        y[h] = (x[h] - mean) * rstd * gain<T, kZeroCentered>(w_H[h]) + b_H[h];
      }
    }
  }
}

template <typename T, bool kRound>
void layernorm_forward_any(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H, const T* b_H,
                           int64_t n_tok, int64_t H, double eps, bool zero_centered) {
  if (zero_centered) {
    layernorm_forward_loop<T, true, kRound>(y_TH, mean_T, rstd_T, x_TH, w_H, b_H, n_tok, H, eps);
  } else {
    layernorm_forward_loop<T, false, kRound>(y_TH, mean_T, rstd_T, x_TH, w_H, b_H, n_tok, H, eps);
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gain, xhat = (x - mean) rstd.
// g is stored in dx first and read back: the compiler may fuse a product into a following
// subtraction (FMA), and g - mean(g) must see the same rounded g as the sum did, or a row of
// equal g (H = 1: dx exactly 0) keeps an ulp of g times rstd, which is up to 1/sqrt(eps).
template <typename T, bool kZeroCentered>
void layernorm_dx(T* dx_TH, const T* dy_TH, const T* x_TH, const T* w_H, const T* mean_T,
                  const T* rstd_T, int64_t n_tok, int64_t H, bool par) {
#pragma omp parallel for schedule(static) if (par)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    const T* dy = dy_TH + t * H;
    T* dx = dx_TH + t * H;
    const T mean = mean_T[t], rstd = rstd_T[t];
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dx[h] = dy[h] * gain<T, kZeroCentered>(w_H[h]);
    T sg = 0, sgx = 0;
#pragma omp simd reduction(+ : sg, sgx)
    for (int64_t h = 0; h < H; ++h) {
      sg += dx[h];
      sgx += dx[h] * ((x[h] - mean) * rstd);
    }
    const T a = sg / T(H), c = sgx / T(H);
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dx[h] = rstd * (dx[h] - a - (x[h] - mean) * rstd * c);
  }
}
}  // namespace

template <typename T>
void layernorm_forward(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H, const T* b_H,
                       int64_t n_tok, int64_t H, double eps, bool zero_centered) {
  layernorm_forward_any<T, false>(y_TH, mean_T, rstd_T, x_TH, w_H, b_H, n_tok, H, eps,
                                  zero_centered);
}

void layernorm_forward_bf16w(float* y_TH, float* mean_T, float* rstd_T, const float* x_TH,
                             const float* w_H, const float* b_H, int64_t n_tok, int64_t H,
                             double eps, bool zero_centered) {
  layernorm_forward_any<float, true>(y_TH, mean_T, rstd_T, x_TH, w_H, b_H, n_tok, H, eps,
                                     zero_centered);
}

template <typename T>
void layernorm_backward(T* dx_TH, T* dw_H, T* db_H, const T* dy_TH, const T* x_TH, const T* w_H,
                        const T* mean_T, const T* rstd_T, int64_t n_tok, int64_t H,
                        bool zero_centered) {
  const bool par = n_tok * H >= kParallelMin;
  if (zero_centered) {
    layernorm_dx<T, true>(dx_TH, dy_TH, x_TH, w_H, mean_T, rstd_T, n_tok, H, par);
  } else {
    layernorm_dx<T, false>(dx_TH, dy_TH, x_TH, w_H, mean_T, rstd_T, n_tok, H, par);
  }
  // dw += sum_t dy * xhat (the gain's offset has no gradient); db += sum_t dy.
  const int64_t n_blocks = (H + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t h0 = b * kColBlock, h1 = std::min(H, h0 + kColBlock);
    T acc_w[kColBlock] = {}, acc_b[kColBlock] = {};
    for (int64_t t = 0; t < n_tok; ++t) {
      const T* x = x_TH + t * H;
      const T* dy = dy_TH + t * H;
      const T mean = mean_T[t], rstd = rstd_T[t];
#pragma omp simd
      for (int64_t h = h0; h < h1; ++h) {
        acc_w[h - h0] += dy[h] * ((x[h] - mean) * rstd);
        acc_b[h - h0] += dy[h];
      }
    }
    for (int64_t h = h0; h < h1; ++h) {
      dw_H[h] += acc_w[h - h0];
      db_H[h] += acc_b[h - h0];
    }
  }
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*,
                                       const float*, int64_t, int64_t, double, bool);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*,
                                        const double*, int64_t, int64_t, double, bool);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, int64_t, int64_t,
                                        bool);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, int64_t,
                                         int64_t, bool);

}  // namespace moecore::ops::cpu
