// y = a + b on the GPU: a grid-stride loop over the elements, the element body shared with the
// CPU fast path (ops::add_element). y may alias a or b: each element is read before it is written
// by the same thread.
#include <algorithm>

#include "ops/add.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void add(T* y, const T* a, const T* b, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = add_element(a[i], b[i]);
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// A grid-stride loop beyond this many blocks: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;
}  // namespace

template <typename T>
void add(void* stream, T* y, const T* a, const T* b, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[add] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = std::min((n + kBlock - 1) / kBlock, kMaxBlocks);
  launch("add", kernels::add<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0, stream, y, a, b,
         n);
}

template void add<float>(void*, float*, const float*, const float*, int64_t);
template void add<double>(void*, double*, const double*, const double*, int64_t);
template void add<int64_t>(void*, int64_t*, const int64_t*, const int64_t*, int64_t);

}  // namespace moecore::ops::cuda
