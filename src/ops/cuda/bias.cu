// The column bias on the GPU. Forward: a grid-stride loop over the elements of y, each adding its
// column's bias. Backward: a thread per column summing the rows in order into a register and
// adding that to db once (no atomics, one writer and one order per element: the CPU fast path's
// order, so the same sums run to run and on either backend).
#include <algorithm>

#include "ops/bias.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void bias_forward(T* y_MN, const T* b_N, int64_t MN, int64_t N) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < MN; i += stride) {
    y_MN[i] += b_N[i % N];
  }
}

// Adjacent threads read adjacent columns of a row: each row's loads coalesce.
template <typename T>
__global__ void bias_backward(T* db_N, const T* dy_MN, int64_t M, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  T acc = 0;
  for (int64_t m = 0; m < M; ++m) acc += dy_MN[m * N + n];
  db_N[n] += acc;
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// A grid-stride loop beyond this many blocks: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;
}  // namespace

template <typename T>
void bias_forward(void* stream, T* y_MN, const T* b_N, int64_t M, int64_t N) {
  MOE_KERNEL_CHECK(M >= 0 && N >= 0, "[bias_forward] negative shape M=" + std::to_string(M) +
                                         " N=" + std::to_string(N));
  const int64_t MN = M * N;
  if (MN == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = std::min((MN + kBlock - 1) / kBlock, kMaxBlocks);
  launch("bias_forward", kernels::bias_forward<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)),
         0, stream, y_MN, b_N, MN, N);
}

template <typename T>
void bias_backward(void* stream, T* db_N, const T* dy_MN, int64_t M, int64_t N) {
  MOE_KERNEL_CHECK(M >= 0 && N >= 0 && N <= int64_t(0x7fffffff) * kBlock,
                   "[bias_backward] shape M=" + std::to_string(M) + " N=" + std::to_string(N) +
                       ": both >= 0, N at most 2^31-1 blocks of " + std::to_string(kBlock));
  if (M == 0 || N == 0) return;  // db gains nothing
  launch("bias_backward", kernels::bias_backward<T>, dim3(unsigned((N + kBlock - 1) / kBlock)),
         dim3(unsigned(kBlock)), 0, stream, db_N, dy_MN, M, N);
}

template void bias_forward<float>(void*, float*, const float*, int64_t, int64_t);
template void bias_forward<double>(void*, double*, const double*, int64_t, int64_t);
template void bias_backward<float>(void*, float*, const float*, int64_t, int64_t);
template void bias_backward<double>(void*, double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
