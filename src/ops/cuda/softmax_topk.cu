// Row softmax, its backward and the router's top-k on the GPU. Softmax: one block per row (token),
// the row's max and sum in ops/cuda/reduce.cuh's fixed trees, so the bits depend on E and the
// values alone. Top-k: a warp per row, K rounds of a warp argmax in the order the CPU fast path's
// insertion selection produces (value descending, index ascending), so the indices and values are
// bitwise the CPU's, ties and -inf included; a row with a NaN runs the CPU's selection itself.
#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/softmax_topk.h"

namespace moecore::ops::cuda {

namespace kernels {
// The max of v over the block, in every thread: the warps' butterflies, then warp 0 over the
// warps' maxima through `shared` (blockDim.x / 32 + 1 values; reusable after a __syncthreads).
template <typename T>
__device__ __forceinline__ T block_max(T v, T* shared) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n_warps = int(blockDim.x) / 32;
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = std::max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T m = lane < n_warps ? shared[lane] : T(-INFINITY);
    for (int offset = 16; offset > 0; offset >>= 1) {
      m = std::max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (lane == 0) shared[n_warps] = m;
  }
  __syncthreads();
  return shared[n_warps];
}

// y = softmax(x) per row; y may alias x (each thread reads and writes its own elements only).
// Dynamic shared memory: blockDim.x / 32 + 1 values of T.
template <typename T>
__global__ void softmax_forward(T* y_TE, const T* x_TE, int64_t E) {
  T* shared = dynamic_shared<T>();
  const int64_t t = blockIdx.x;
  const T* x = x_TE + t * E;
  T* y = y_TE + t * E;
  T m = -INFINITY;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) m = std::max(m, x[e]);
  m = block_max(m, shared);
  T s = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const T v = std::exp(x[e] - m);
    y[e] = v;
    s += v;
  }
  // block_sum writes the warps' slots before its first barrier, block_max's result slot after it.
  s = block_sum(s, shared);
  // A row of all -inf gives NaN (0/0), as the CPU paths and PyTorch do.
  const T inv = T(1) / s;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    y[e] *= inv;
  }
}

// dx = y * (dy - sum(dy * y)) per row; dx may alias dy (the dot is complete before any write).
template <typename T>
__global__ void softmax_backward(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t E) {
  T* shared = dynamic_shared<T>();
  const int64_t t = blockIdx.x;
  const T* dy = dy_TE + t * E;
  const T* y = y_TE + t * E;
  T dot = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dot += dy[e] * y[e];
  dot = block_sum(dot, shared);
  T* dx = dx_TE + t * E;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dx[e] = y[e] * (dy[e] - dot);
}

// A warp per row: K rounds of a warp argmax. cpu::topk's insertion selection returns, for a row
// without NaN, the first K of the row ordered by value descending, index ascending (an entry moves
// only past strictly smaller values; a tie never displaces). So round k takes the largest entry
// after round k - 1's in that order: each lane scans its entries e = lane, lane + 32, ..., then a
// butterfly keeps the larger (the lower index on a tie), the same pick in every lane. A row with a
// NaN (its insertion order is not a sort order) runs topk_row itself on lane 0. 32-bit indices.
template <typename T>
__global__ void topk(int32_t* idx_TK, T* val_TK, const T* x_TE, int32_t n_tok, int32_t E,
                     int32_t K) {
  const int32_t t = int32_t(blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u);
  const int32_t lane = int32_t(threadIdx.x % 32u);
  if (t >= n_tok) return;  // the whole warp
  const T* x = x_TE + int64_t(t) * E;
  int32_t* idx = idx_TK + int64_t(t) * K;
  T* val = val_TK + int64_t(t) * K;
  bool nan = false;
  for (int32_t e = lane; e < E; e += 32) nan = nan || x[e] != x[e];
  if (__any_sync(0xffffffffu, nan)) {
    if (lane == 0) topk_row(idx, val, x, E, K);
    return;
  }
  T last_v = T(0);
  int32_t last_e = -1;  // none yet
  for (int32_t k = 0; k < K; ++k) {
    T best_v = T(0);
    int32_t best_e = -1;
    for (int32_t e = lane; e < E; e += 32) {
      const T v = x[e];
      const bool after = last_e < 0 || v < last_v || (v == last_v && e > last_e);
      if (after && (best_e < 0 || v > best_v)) {  // e ascends: a tie keeps the lower index
        best_v = v;
        best_e = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {  // the index travels; its value is read from the row
      const int32_t e = __shfl_xor_sync(0xffffffffu, best_e, o);
      const T v = e >= 0 ? x[e] : T(0);
      if (e >= 0 && (best_e < 0 || v > best_v || (v == best_v && e < best_e))) {
        best_v = v;
        best_e = e;
      }
    }
    if (lane == 0) {
      idx[k] = best_e;
      val[k] = best_v;
    }
    last_v = best_v;
    last_e = best_e;
  }
}
}  // namespace kernels

namespace {
// Threads per block for a row: a warp per 32 experts up to 8 warps.
constexpr int64_t kMaxRowBlock = 256;
// Threads per block of the top-k's warp-per-row grid (4 rows a block).
constexpr int64_t kTopkBlock = 128;

void check_rows(const char* op, int64_t n_tok, int64_t E) {
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff && E > 0,
                   std::string("[") + op + "] tokens=" + std::to_string(n_tok) +
                       " (0 to 2^31-1, one block each), experts=" + std::to_string(E) + " (> 0)");
}
int64_t row_block(int64_t E) {
  return std::min(kMaxRowBlock, (E + 31) / 32 * 32);
}
}  // namespace

template <typename T>
void softmax_forward(void* stream, T* y_TE, const T* x_TE, int64_t n_tok, int64_t E) {
  check_rows("softmax_forward", n_tok, E);
  if (n_tok == 0) return;  // a grid of no blocks is a launch error
  const int64_t block = row_block(E);
  launch("softmax_forward", kernels::softmax_forward<T>, dim3(unsigned(n_tok)),
         dim3(unsigned(block)), size_t(block / 32 + 1) * sizeof(T), stream, y_TE, x_TE, E);
}

template <typename T>
void softmax_backward(void* stream, T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok,
                      int64_t E) {
  check_rows("softmax_backward", n_tok, E);
  if (n_tok == 0) return;
  const int64_t block = row_block(E);
  launch("softmax_backward", kernels::softmax_backward<T>, dim3(unsigned(n_tok)),
         dim3(unsigned(block)), size_t(block / 32 + 1) * sizeof(T), stream, dx_TE, dy_TE, y_TE, E);
}

template <typename T>
void topk(void* stream, int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E,
          int64_t K) {
  MOE_KERNEL_CHECK(K >= 1 && K <= E && E <= 0x7fffffff, "[topk] K=" + std::to_string(K) +
                                                            " outside [1, E=" + std::to_string(E) +
                                                            "]: lower --moe-router-topk");
  MOE_KERNEL_CHECK(n_tok >= 0 && n_tok <= 0x7fffffff,
                   "[topk] tokens=" + std::to_string(n_tok) + " outside [0, 2^31-1]");
  if (n_tok == 0) return;
  const int64_t rows_per_block = kTopkBlock / 32;
  launch("topk", kernels::topk<T>, dim3(unsigned((n_tok + rows_per_block - 1) / rows_per_block)),
         dim3(unsigned(kTopkBlock)), 0, stream, idx_TK, val_TK, x_TE, int32_t(n_tok), int32_t(E),
         int32_t(K));
}

template void softmax_forward<float>(void*, float*, const float*, int64_t, int64_t);
template void softmax_forward<double>(void*, double*, const double*, int64_t, int64_t);
template void softmax_backward<float>(void*, float*, const float*, const float*, int64_t, int64_t);
template void softmax_backward<double>(void*, double*, const double*, const double*, int64_t,
                                       int64_t);
template void topk<float>(void*, int32_t*, float*, const float*, int64_t, int64_t, int64_t);
template void topk<double>(void*, int32_t*, double*, const double*, int64_t, int64_t, int64_t);

}  // namespace moecore::ops::cuda
