// LayerNorm on the GPU, as rmsnorm.cu does RMSNorm: one block per row (token), the row's sum and
// then its sum of centred squares in fixed trees (reduce.cuh: the order depends on the block size
// alone), products rounded one at a time (rounding.cuh: no contraction left to nvcc, so the grid
// emulator computes the GPU's roundings, and the backward's g is the same value in its sum and in
// dx, see layernorm_backward_dx). The bf16w form is the same kernel with y rounded to bf16 values
// (ops::f32_bf16_rounded) in the same pass: bitwise round_f32_to_bf16 of this backend's
// layernorm_forward. The backward: dx by the same block-per-row scheme, dw and db together by
// reduce_cols.cuh's two-stage column reduction (blocks over splits of the tokens, then the splits'
// partials in a fixed order: no atomics, the order set by the shape alone).
#include <algorithm>
#include <cmath>
#include <string>

#include "ops/cast.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/cuda/reduce_cols.cuh"
#include "ops/cuda/rounding.cuh"
#include "ops/layernorm.h"

namespace moecore::ops::cuda {

namespace kernels {
// The gain applied to xhat: w, or 1 + w for the zero-centred (layernorm-1p) weight.
template <typename T>
__device__ __forceinline__ T gain(T w, bool zero_centered) {
  return zero_centered ? T(1) + w : w;
}

// blockDim.x a multiple of 32; dynamic shared memory: 2 (blockDim.x / 32 + 1) values of T (one
// block_sum's scratch for the mean, one for the variance).
template <typename T, bool kRound>
__global__ void layernorm_forward(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H,
                                  const T* b_H, int64_t H, double eps, bool zero_centered) {
  T* shared = dynamic_shared<T>();
  const int n_shared = int(blockDim.x) / 32 + 1;
  const int64_t t = blockIdx.x;
  const T* x = x_TH + t * H;
  T sum = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) sum += x[h];
  const T mean = block_sum(sum, shared) / T(H);
  // The mean subtracted before squaring: one pass of sum(x^2) - mean^2 cancels when |mean| >> std.
  T ss = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const T d = x[h] - mean;
    ss = add_rn(ss, mul_rn(d, d));
  }
  ss = block_sum(ss, shared + n_shared);
  const T rstd = T(1) / std::sqrt(ss / T(H) + T(eps));
  if (threadIdx.x == 0) {
    mean_T[t] = mean;
    rstd_T[t] = rstd;
  }
  T* y = y_TH + t * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const T v = add_rn(mul_rn(mul_rn(x[h] - mean, rstd), gain(w_H[h], zero_centered)), b_H[h]);
    if constexpr (kRound) {
      y[h] = f32_bf16_rounded(v);
    } else {
      y[h] = v;
    }
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy * gain, xhat = (x - mean) rstd.
// Shared memory as the forward's.
template <typename T>
__global__ void layernorm_backward_dx(T* dx_TH, const T* dy_TH, const T* x_TH, const T* w_H,
                                      const T* mean_T, const T* rstd_T, int64_t H,
                                      bool zero_centered) {
  T* shared = dynamic_shared<T>();
  const int n_shared = int(blockDim.x) / 32 + 1;
  const int64_t t = blockIdx.x;
  const T* x = x_TH + t * H;
  const T* dy = dy_TH + t * H;
  const T mean = mean_T[t], rstd = rstd_T[t];
  T sg = 0, sgx = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const T g = mul_rn(dy[h], gain(w_H[h], zero_centered));
    sg += g;
    sgx = add_rn(sgx, mul_rn(g, mul_rn(x[h] - mean, rstd)));
  }
  const T a = block_sum(sg, shared) / T(H);
  const T c = block_sum(sgx, shared + n_shared) / T(H);
  T* dx = dx_TH + t * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    // g recomputed with the same rounding as in the sums (a product fused into the sum would
    // differ), so a row of equal g (H = 1: dx exactly 0) gives g - a exactly 0, not an ulp of g
    // times rstd (up to 1 / sqrt(eps)).
    const T g = mul_rn(dy[h], gain(w_H[h], zero_centered));
    dx[h] = mul_rn(rstd, (g - a) - mul_rn(mul_rn(x[h] - mean, rstd), c));
  }
}

// dw's and db's terms for reduce_cols.cuh: dy xhat and dy of token m, column h (xhat's products
// rounded one at a time, as the forward's).
template <typename T>
struct LayernormDwDbTerm {
  static constexpr int kOut = 2;
  const T* dy_TH;
  const T* x_TH;
  const T* mean_T;
  const T* rstd_T;
  int n_tok;
  __device__ __forceinline__ RowRange rows(int) const { return {0, n_tok}; }
  template <int kLanes>
  __device__ __forceinline__ void add(T (&acc)[2][kLanes], size_t i, int m) const {
    T dy[kLanes], x[kLanes];
    load_lanes<kLanes>(dy_TH + i, dy);
    load_lanes<kLanes>(x_TH + i, x);
    const T mean = mean_T[m], rstd = rstd_T[m];
    for (int l = 0; l < kLanes; ++l) {
      acc[0][l] = add_rn(acc[0][l], mul_rn(dy[l], mul_rn(x[l] - mean, rstd)));
      acc[1][l] += dy[l];
    }
  }
};
}  // namespace kernels

namespace {
// Threads per block: a warp per 32 elements up to 8 warps (as rmsnorm.cu).
constexpr int64_t kMaxBlock = 256;

void check_shape(int64_t n_tok, int64_t H, const char* op) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff && H > 0,
                   std::string("[") + op + "] tokens=" + std::to_string(n_tok) +
                       " (0 to 2^31-1, one block each), hidden=" + std::to_string(H) + " (> 0)");
}

template <typename T, bool kRound>
void forward_launch(void* stream, T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H,
                    const T* b_H, int64_t n_tok, int64_t H, double eps, bool zero_centered,
                    const char* op) {
  check_shape(n_tok, H, op);
  if (n_tok == 0) return;  // a grid of no blocks is a launch error
  const int64_t block = std::min(kMaxBlock, (H + 31) / 32 * 32);
  const size_t smem = 2 * size_t(block / 32 + 1) * sizeof(T);
  launch(op, kernels::layernorm_forward<T, kRound>, dim3(unsigned(n_tok)), dim3(unsigned(block)),
         smem, stream, y_TH, mean_T, rstd_T, x_TH, w_H, b_H, H, eps, zero_centered);
}
}  // namespace

template <typename T>
void layernorm_forward(void* stream, T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H,
                       const T* b_H, int64_t n_tok, int64_t H, double eps, bool zero_centered) {
  forward_launch<T, false>(stream, y_TH, mean_T, rstd_T, x_TH, w_H, b_H, n_tok, H, eps,
                           zero_centered, "layernorm_forward");
}

void layernorm_forward_bf16w(void* stream, float* y_TH, float* mean_T, float* rstd_T,
                             const float* x_TH, const float* w_H, const float* b_H, int64_t n_tok,
                             int64_t H, double eps, bool zero_centered) {
  forward_launch<float, true>(stream, y_TH, mean_T, rstd_T, x_TH, w_H, b_H, n_tok, H, eps,
                              zero_centered, "layernorm_forward_bf16w");
}

template <typename T>
void layernorm_backward(void* stream, T* dx_TH, T* dw_H, T* db_H, const T* dy_TH, const T* x_TH,
                        const T* w_H, const T* mean_T, const T* rstd_T, int64_t n_tok, int64_t H,
                        bool zero_centered) {
  check_shape(n_tok, H, "layernorm_backward");
  if (n_tok == 0) return;  // dx has no rows and dw, db gain nothing
  const int64_t block = std::min(kMaxBlock, (H + 31) / 32 * 32);
  const size_t smem = 2 * size_t(block / 32 + 1) * sizeof(T);
  launch("layernorm_backward_dx", kernels::layernorm_backward_dx<T>, dim3(unsigned(n_tok)),
         dim3(unsigned(block)), smem, stream, dx_TH, dy_TH, x_TH, w_H, mean_T, rstd_T, H,
         zero_centered);
  // dw and db: reduce_cols.cuh's two stages over the tokens, both in one pass over dy and x.
  const ColReducePlan p = plan_col_reduce<T>(n_tok, H, 2, "layernorm_backward_dwdb");
  const kernels::LayernormDwDbTerm<T> term{dy_TH, x_TH, mean_T, rstd_T, int(n_tok)};
  T* const out[2] = {dw_H, db_H};
  reduce_cols(stream, p, term, out, 1, H % kColVecLanes<T> == 0 && all_16_aligned(dy_TH, x_TH),
              "layernorm_backward_dwdb", "layernorm_backward_dwdb_partials");
}

template void layernorm_forward<float>(void*, float*, float*, float*, const float*, const float*,
                                       const float*, int64_t, int64_t, double, bool);
template void layernorm_forward<double>(void*, double*, double*, double*, const double*,
                                        const double*, const double*, int64_t, int64_t, double,
                                        bool);
template void layernorm_backward<float>(void*, float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, int64_t, int64_t,
                                        bool);
template void layernorm_backward<double>(void*, double*, double*, double*, const double*,
                                         const double*, const double*, const double*, const double*,
                                         int64_t, int64_t, bool);

}  // namespace moecore::ops::cuda
