// RMSNorm forward on the GPU: one block per row (token). Each thread sums the squares of its
// strided elements, each warp reduces by a fixed shuffle butterfly, the warps' sums meet in shared
// memory and warp 0 reduces them; rstd and the elements use the bodies shared with the CPU fast
// path (ops::rmsnorm_rstd, ops::rmsnorm_element). The summation order depends on the block size
// alone: the output is the same run to run. The bf16w form is the same kernel with y rounded to
// bf16 values (ops::f32_bf16_rounded) in the same pass. The backward: dx by the same block-per-row
// scheme (the row's sum of w dy x), dw by reduce_cols.cuh's two-stage column reduction (blocks of
// 8 warps over splits of the tokens, then the splits' partials in a fixed order: no atomics, the
// order set by the shape alone). The q/k norms run here too, with heads x tokens rows of D.
#include <algorithm>
#include <string>

#include "ops/cast.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/cuda/reduce_cols.cuh"
#include "ops/rmsnorm.h"

namespace moecore::ops::cuda {

namespace kernels {
// blockDim.x a multiple of 32; dynamic shared memory: blockDim.x / 32 + 1 values of T (the warps'
// sums, then the row's rstd). kRound (f32 only): y rounded to bf16 values.
template <typename T, bool kRound>
__global__ void rmsnorm_forward(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t H,
                                double eps) {
  T* shared = dynamic_shared<T>();
  const int64_t t = blockIdx.x;
  const T* x = x_TH + t * H;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n_warps = int(blockDim.x) / 32;
  T ss = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) ss += x[h] * x[h];
  ss = warp_sum(ss);
  if (lane == 0) shared[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    T v = lane < n_warps ? shared[lane] : T(0);
    v = warp_sum(v);
    if (lane == 0) {
      const T rstd = rmsnorm_rstd(v, H, eps);
      shared[n_warps] = rstd;
      rstd_T[t] = rstd;
    }
  }
  __syncthreads();
  const T rstd = shared[n_warps];
  T* y = y_TH + t * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const T v = rmsnorm_element(x[h], rstd, w_H[h]);
    if constexpr (kRound) {
      y[h] = f32_bf16_rounded(v);
    } else {
      y[h] = v;
    }
  }
}

// Shared memory as rmsnorm_forward's (the warps' sums, then the row's coefficient c).
template <typename T>
__global__ void rmsnorm_backward_dx(T* dx_TH, const T* dy_TH, const T* x_TH, const T* w_H,
                                    const T* rstd_T, int64_t H) {
  T* shared = dynamic_shared<T>();
  const int64_t t = blockIdx.x;
  const T* x = x_TH + t * H;
  const T* dy = dy_TH + t * H;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n_warps = int(blockDim.x) / 32;
  const T rstd = rstd_T[t];
  T dot = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dot += w_H[h] * dy[h] * x[h];
  dot = warp_sum(dot);
  if (lane == 0) shared[warp] = dot;
  __syncthreads();
  if (warp == 0) {
    T v = lane < n_warps ? shared[lane] : T(0);
    v = warp_sum(v);
    if (lane == 0) shared[n_warps] = rmsnorm_backward_coeff(rstd, v, H);
  }
  __syncthreads();
  const T c = shared[n_warps];
  T* dx = dx_TH + t * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    dx[h] = rmsnorm_backward_element(dy[h], x[h], w_H[h], rstd, c);
  }
}

// dw's terms for reduce_cols.cuh: dy x rstd of token m, column h, multiplied in that order.
template <typename T>
struct RmsnormDwTerm {
  static constexpr int kOut = 1;
  const T* dy_TH;
  const T* x_TH;
  const T* rstd_T;
  int n_tok;
  __device__ __forceinline__ RowRange rows(int) const { return {0, n_tok}; }
  template <int kLanes>
  __device__ __forceinline__ void add(T (&acc)[1][kLanes], size_t i, int m) const {
    T dy[kLanes], x[kLanes];
    load_lanes<kLanes>(dy_TH + i, dy);
    load_lanes<kLanes>(x_TH + i, x);
    const T rstd = rstd_T[m];
    for (int l = 0; l < kLanes; ++l) acc[0][l] += dy[l] * x[l] * rstd;
  }
};
}  // namespace kernels

namespace {
// Threads per block: a warp per 32 elements up to 8 warps (a row of 4096 gives each thread 16).
constexpr int64_t kMaxBlock = 256;

template <typename T, bool kRound>
void rmsnorm_forward_launch(void* stream, T* y_TH, T* rstd_T, const T* x_TH, const T* w_H,
                            int64_t n_tok, int64_t H, double eps, const char* op) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff && H > 0,
                   std::string("[") + op + "] tokens=" + std::to_string(n_tok) +
                       " (0 to 2^31-1, one block each), hidden=" + std::to_string(H) + " (> 0)");
  if (n_tok == 0) return;  // a grid of no blocks is a launch error
  const int64_t block = std::min(kMaxBlock, (H + 31) / 32 * 32);
  const size_t smem = size_t(block / 32 + 1) * sizeof(T);
  launch(op, kernels::rmsnorm_forward<T, kRound>, dim3(unsigned(n_tok)), dim3(unsigned(block)),
         smem, stream, y_TH, rstd_T, x_TH, w_H, H, eps);
}
}  // namespace

template <typename T>
void rmsnorm_forward(void* stream, T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok,
                     int64_t H, double eps) {
  rmsnorm_forward_launch<T, false>(stream, y_TH, rstd_T, x_TH, w_H, n_tok, H, eps, "rmsnorm");
}

void rmsnorm_forward_bf16w(void* stream, float* y_TH, float* rstd_T, const float* x_TH,
                           const float* w_H, int64_t n_tok, int64_t H, double eps) {
  rmsnorm_forward_launch<float, true>(stream, y_TH, rstd_T, x_TH, w_H, n_tok, H, eps,
                                      "rmsnorm_forward_bf16w");
}

template <typename T>
void rmsnorm_backward(void* stream, T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                      const T* rstd_T, int64_t n_tok, int64_t H) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff && H > 0,
                   "[rmsnorm_backward] tokens=" + std::to_string(n_tok) +
                       " (0 to 2^31-1, one block each), hidden=" + std::to_string(H) + " (> 0)");
  if (n_tok == 0) return;  // dx has no rows and dw gains nothing
  const int64_t block = std::min(kMaxBlock, (H + 31) / 32 * 32);
  const size_t smem = size_t(block / 32 + 1) * sizeof(T);
  launch("rmsnorm_backward_dx", kernels::rmsnorm_backward_dx<T>, dim3(unsigned(n_tok)),
         dim3(unsigned(block)), smem, stream, dx_TH, dy_TH, x_TH, w_H, rstd_T, H);
  // dw: reduce_cols.cuh's two stages over the tokens (the q/k norms' many rows of D columns too).
  const ColReducePlan p = plan_col_reduce<T>(n_tok, H, 1, "rmsnorm_backward_dw");
  const kernels::RmsnormDwTerm<T> term{dy_TH, x_TH, rstd_T, int(n_tok)};
  T* const out[1] = {dw_H};
  reduce_cols(stream, p, term, out, 1, H % kColVecLanes<T> == 0 && all_16_aligned(dy_TH, x_TH),
              "rmsnorm_backward_dw", "rmsnorm_backward_dw_partials");
}

template void rmsnorm_forward<float>(void*, float*, float*, const float*, const float*, int64_t,
                                     int64_t, double);
template void rmsnorm_forward<double>(void*, double*, double*, const double*, const double*,
                                      int64_t, int64_t, double);

template void rmsnorm_backward<float>(void*, float*, float*, const float*, const float*,
                                      const float*, const float*, int64_t, int64_t);
template void rmsnorm_backward<double>(void*, double*, double*, const double*, const double*,
                                       const double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
