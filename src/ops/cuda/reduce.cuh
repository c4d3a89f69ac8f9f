// Sums across a warp and across a block in fixed trees (shuffle butterflies, then the warps' sums
// through shared memory): the association depends on the block size alone, so a kernel's output
// is the same run to run (no atomics).
#pragma once

#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

// The sum of v over the 32 lanes of a full warp, in every lane.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block, in every thread. Every thread of the block must call it (it has
// barriers); blockDim.x a multiple of 32; `shared` holds blockDim.x / 32 + 1 values of T and may
// be reused only after another __syncthreads.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n_warps = int(blockDim.x) / 32;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < n_warps ? shared[lane] : T(0);
    s = warp_sum(s);
    if (lane == 0) shared[n_warps] = s;
  }
  __syncthreads();
  return shared[n_warps];
}

// The max of v over the block, in every thread, with block_sum's requirements (`shared` holds
// blockDim.x / 32 + 1 values). Exact, so the tree's shape does not matter for the value. A NaN
// never replaces a number and a number never replaces a NaN: start every thread from the row's
// first element (as the row kernels do) and the max is NaN exactly when that element is, as on
// the CPU, in any tree.
template <typename T>
__device__ __forceinline__ T block_max(T v, T* shared) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n_warps = int(blockDim.x) / 32;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < n_warps ? shared[lane] : shared[0];
    for (int offset = 16; offset > 0; offset >>= 1) {
      const T o = __shfl_xor_sync(0xffffffffu, s, offset);
      s = o > s ? o : s;
    }
    if (lane == 0) shared[n_warps] = s;
  }
  __syncthreads();
  return shared[n_warps];
}

}  // namespace moecore::ops::cuda
