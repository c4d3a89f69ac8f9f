// The shared expert's sigmoid gate on the GPU: a block per row (token), threads striding over H.
// The gate is one device exp per row, taken by every thread of the row alike (the forward and the
// backward get the same bits from the same logit). The backward's dot sum_h dy s meets in a fixed
// block tree (ops/cuda/reduce.cuh): bitwise the same run to run, no atomics; within the dtype's
// tolerance of the reference (the CPU adds the row in index order). ds may alias dy: each
// element is read and then written by the same thread.
#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/sigmoid_gate.h"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__device__ __forceinline__ T sigmoid(T l) {
  return T(1) / (T(1) + std::exp(-l));
}

template <typename T>
__global__ void sigmoid_gate_forward(T* y_NH, const T* s_NH, const T* l_N, int64_t H) {
  const int64_t n = blockIdx.x;
  const T g = sigmoid(l_N[n]);
  const T* s = s_NH + n * H;
  T* y = y_NH + n * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) y[h] += g * s[h];
}

// Dynamic shared memory: blockDim.x / 32 + 1 values of T.
template <typename T>
__global__ void sigmoid_gate_backward(T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH,
                                      const T* l_N, int64_t H) {
  const int64_t n = blockIdx.x;
  const T g = sigmoid(l_N[n]);
  const T* dy = dy_NH + n * H;
  const T* s = s_NH + n * H;
  T part = 0;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) part += dy[h] * s[h];
  const T dot = block_sum(part, dynamic_shared<T>());
  if (threadIdx.x == 0) dl_N[n] = g * (T(1) - g) * dot;
  T* ds = ds_NH + n * H;  // may alias dy: this thread read these elements above
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) ds[h] = g * dy[h];
}
}  // namespace kernels

namespace {
// Threads per block: a warp per 32 elements up to 8 warps.
constexpr int64_t kMaxBlock = 256;

std::string shape(int64_t N, int64_t H) {
  return "rows=" + std::to_string(N) +
         " (0 to 2^31-1, one block each), hidden=" + std::to_string(H) + " (>= 0)";
}
}  // namespace

template <typename T>
void sigmoid_gate_forward(void* stream, T* y_NH, const T* s_NH, const T* l_N, int64_t N,
                          int64_t H) {
  MOE_KERNEL_CHECK(N >= 0 && N <= 0x7fffffff && H >= 0, "[sigmoid_gate] " + shape(N, H));
  if (N == 0 || H == 0) return;  // nothing to add to
  const int64_t block = std::min(kMaxBlock, (H + 31) / 32 * 32);
  launch("sigmoid_gate_forward", kernels::sigmoid_gate_forward<T>, dim3(unsigned(N)),
         dim3(unsigned(block)), 0, stream, y_NH, s_NH, l_N, H);
}

template <typename T>
void sigmoid_gate_backward(void* stream, T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH,
                           const T* l_N, int64_t N, int64_t H) {
  MOE_KERNEL_CHECK(N >= 0 && N <= 0x7fffffff && H >= 0, "[sigmoid_gate_backward] " + shape(N, H));
  if (N == 0) return;
  // H = 0 still writes dl (an empty dot: 0); a block of one warp does it.
  const int64_t block = std::max<int64_t>(32, std::min(kMaxBlock, (H + 31) / 32 * 32));
  const size_t smem = size_t(block / 32 + 1) * sizeof(T);
  launch("sigmoid_gate_backward", kernels::sigmoid_gate_backward<T>, dim3(unsigned(N)),
         dim3(unsigned(block)), smem, stream, ds_NH, dl_N, dy_NH, s_NH, l_N, H);
}

template void sigmoid_gate_forward<float>(void*, float*, const float*, const float*, int64_t,
                                          int64_t);
template void sigmoid_gate_forward<double>(void*, double*, const double*, const double*, int64_t,
                                           int64_t);
template void sigmoid_gate_backward<float>(void*, float*, float*, const float*, const float*,
                                           const float*, int64_t, int64_t);
template void sigmoid_gate_backward<double>(void*, double*, double*, const double*, const double*,
                                            const double*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
