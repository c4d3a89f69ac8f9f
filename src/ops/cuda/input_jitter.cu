// The router's input jitter on the GPU: grid-stride loops over the elements. The draw is
// core/rng.h's rng_uniform (shared with the CPU) at base + i with base = *step * stride read from
// device memory inside the kernel; the factor and the backward's accumulation are the op's
// explicit fmas (input_jitter.h): bitwise the CPU's.
#include <algorithm>
#include <cmath>
#include <string>

#include "core/rng.h"
#include "ops/cuda/launch.cuh"
#include "ops/input_jitter.h"

namespace moecore::ops::cuda {

namespace kernels {
__device__ __forceinline__ int64_t thread_index() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() {
  return int64_t(gridDim.x) * blockDim.x;
}

template <typename T>
__global__ void input_jitter_forward(T* jitter, T* y, const T* x, double one_minus_eps,
                                     double two_eps, uint64_t key, const int64_t* step,
                                     int64_t stride, uint32_t lane, int64_t n) {
  const uint64_t base = static_cast<uint64_t>(*step) * static_cast<uint64_t>(stride);
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const double u = rng_uniform(key, base + static_cast<uint64_t>(i), lane);
    const T j = static_cast<T>(std::fma(two_eps, u, one_minus_eps));
    jitter[i] = j;
    y[i] = x[i] * j;
  }
}

__global__ void input_jitter_advance(int64_t* step) {
  ++*step;
}

template <typename T>
__global__ void input_jitter_backward(T* dx, const T* dy, const T* jitter, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    dx[i] = std::fma(dy[i], jitter[i], dx[i]);
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill a GPU

int64_t blocks_for(int64_t n) {
  return std::min(kMaxBlocks, (n + kBlock - 1) / kBlock);
}
}  // namespace

template <typename T>
void input_jitter_forward(void* stream, T* jitter, T* y, const T* x, double eps, uint64_t key,
                          const int64_t* step, int64_t stride, uint32_t lane, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0 && stride >= 0 && (step != nullptr || n == 0),
                   "[input_jitter] n=" + std::to_string(n) + ", stride=" + std::to_string(stride) +
                       ": both must be >= 0, and the step counter set when n > 0");
  if (n == 0) return;  // a grid of no blocks is a launch error
  // 2 eps and 1 - eps as the CPU forms them (input_jitter.h: fma(2 eps, u, 1 - eps)).
  launch("input_jitter_forward", kernels::input_jitter_forward<T>, dim3(unsigned(blocks_for(n))),
         dim3(unsigned(kBlock)), 0, stream, jitter, y, x, 1.0 - eps, 2.0 * eps, key, step, stride,
         lane, n);
}

void input_jitter_advance(void* stream, int64_t* step) {
  MOE_KERNEL_CHECK(step != nullptr, "[input_jitter_advance] no step counter: pass its buffer");
  launch("input_jitter_advance", kernels::input_jitter_advance, dim3(1), dim3(1), 0, stream, step);
}

template <typename T>
void input_jitter_backward(void* stream, T* dx, const T* dy, const T* jitter, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[input_jitter_backward] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  launch("input_jitter_backward", kernels::input_jitter_backward<T>, dim3(unsigned(blocks_for(n))),
         dim3(unsigned(kBlock)), 0, stream, dx, dy, jitter, n);
}

template void input_jitter_forward<float>(void*, float*, float*, const float*, double, uint64_t,
                                          const int64_t*, int64_t, uint32_t, int64_t);
template void input_jitter_forward<double>(void*, double*, double*, const double*, double, uint64_t,
                                           const int64_t*, int64_t, uint32_t, int64_t);
template void input_jitter_backward<float>(void*, float*, const float*, const float*, int64_t);
template void input_jitter_backward<double>(void*, double*, const double*, const double*, int64_t);

}  // namespace moecore::ops::cuda
