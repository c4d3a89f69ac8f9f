// f32 <-> bf16 conversions on the GPU: grid-stride loops over the elements, the element bodies
// shared with the CPU fast path (ops::f32_to_bf16_bits, f32_bf16_rounded, bf16_bits_to_f32: the
// same bit arithmetic, so bitwise the references, NaN payloads, infinities and denormals
// included; no hardware cvt.rn.bf16, which would need its own proof). y may be x in
// round_f32_to_bf16: each element is read before it is written by the same thread.
#include <algorithm>

#include "ops/cast.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
__global__ void cast_f32_to_bf16(uint16_t* y, const float* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = f32_to_bf16_bits(x[i]);
  }
}
__global__ void cast_bf16_to_f32(float* y, const uint16_t* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = bf16_bits_to_f32(x[i]);
  }
}
__global__ void round_f32_to_bf16(float* y, const float* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = f32_bf16_rounded(x[i]);
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// A grid-stride loop beyond this many blocks: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;

dim3 grid_for(int64_t n) {
  return dim3(unsigned(std::min((n + kBlock - 1) / kBlock, kMaxBlocks)));
}
}  // namespace

void cast_f32_to_bf16(void* stream, bf16* y, const float* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[cast_f32_to_bf16] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;  // a grid of no blocks is a launch error
  static_assert(sizeof(bf16) == sizeof(uint16_t), "bf16 must be its 16 raw bits");
  launch("cast_f32_to_bf16", kernels::cast_f32_to_bf16, grid_for(n), dim3(unsigned(kBlock)), 0,
         stream, reinterpret_cast<uint16_t*>(y), x, n);
}

void cast_bf16_to_f32(void* stream, float* y, const bf16* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[cast_bf16_to_f32] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  launch("cast_bf16_to_f32", kernels::cast_bf16_to_f32, grid_for(n), dim3(unsigned(kBlock)), 0,
         stream, y, reinterpret_cast<const uint16_t*>(x), n);
}

void round_f32_to_bf16(void* stream, float* y, const float* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[round_f32_to_bf16] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  launch("round_f32_to_bf16", kernels::round_f32_to_bf16, grid_for(n), dim3(unsigned(kBlock)), 0,
         stream, y, x, n);
}

}  // namespace moecore::ops::cuda
