// f32 <-> bf16 conversions on the GPU: grid-stride loops over the elements, the element bodies
// shared with the CPU fast path (ops::f32_to_bf16_bits, f32_bf16_rounded, bf16_bits_to_f32: the
// same bit arithmetic, so bitwise the references, NaN payloads, infinities and denormals
// included; no hardware cvt.rn.bf16, which would need its own proof). Memory-bound, so each
// thread moves 16 bytes of input a step (float4: 4 f32; int4: 8 bf16) when the pointers allow
// (the arena's buffers are 16-byte aligned), the last n % 4 (or 8) elements one at a time; other
// pointers take the one-element kernels. y may be x in round_f32_to_bf16: each element is read
// before it is written by the same thread.
#include <algorithm>
#include <cstdint>

#include "ops/cast.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
__device__ __forceinline__ int64_t thread_index() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() {
  return int64_t(gridDim.x) * blockDim.x;
}

// x 16-byte aligned: 4 elements a step (a 16-byte load, four 2-byte stores), then the tail.
__global__ void cast_f32_to_bf16_vec(uint16_t* y, const float* x, int64_t n) {
  const int64_t n4 = n / 4, stride = thread_count();
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t i = thread_index(); i < n4; i += stride) {
    const float4 v = x4[i];
    uint16_t* o = y + 4 * i;
    o[0] = f32_to_bf16_bits(v.x);
    o[1] = f32_to_bf16_bits(v.y);
    o[2] = f32_to_bf16_bits(v.z);
    o[3] = f32_to_bf16_bits(v.w);
  }
  for (int64_t i = 4 * n4 + thread_index(); i < n; i += stride) y[i] = f32_to_bf16_bits(x[i]);
}
__global__ void cast_f32_to_bf16(uint16_t* y, const float* x, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) y[i] = f32_to_bf16_bits(x[i]);
}

// x and y 16-byte aligned: 8 elements a step (a 16-byte load, two 16-byte stores), then the tail.
__global__ void cast_bf16_to_f32_vec(float* y, const uint16_t* x, int64_t n) {
  const int64_t n8 = n / 8, stride = thread_count();
  const int4* x8 = reinterpret_cast<const int4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int64_t i = thread_index(); i < n8; i += stride) {
    const int4 v = x8[i];
    // Each 32-bit word holds two bf16, the lower-addressed one in its low half (little-endian).
    const auto lo = [](int w) { return bf16_bits_to_f32(uint16_t(uint32_t(w) & 0xffffu)); };
    const auto hi = [](int w) { return bf16_bits_to_f32(uint16_t(uint32_t(w) >> 16)); };
    y4[2 * i] = make_float4(lo(v.x), hi(v.x), lo(v.y), hi(v.y));
    y4[2 * i + 1] = make_float4(lo(v.z), hi(v.z), lo(v.w), hi(v.w));
  }
  for (int64_t i = 8 * n8 + thread_index(); i < n; i += stride) y[i] = bf16_bits_to_f32(x[i]);
}
__global__ void cast_bf16_to_f32(float* y, const uint16_t* x, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) y[i] = bf16_bits_to_f32(x[i]);
}

// x and y 16-byte aligned: 4 elements a step, then the tail.
__global__ void round_f32_to_bf16_vec(float* y, const float* x, int64_t n) {
  const int64_t n4 = n / 4, stride = thread_count();
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int64_t i = thread_index(); i < n4; i += stride) {
    const float4 v = x4[i];
    y4[i] = make_float4(f32_bf16_rounded(v.x), f32_bf16_rounded(v.y), f32_bf16_rounded(v.z),
                        f32_bf16_rounded(v.w));
  }
  for (int64_t i = 4 * n4 + thread_index(); i < n; i += stride) y[i] = f32_bf16_rounded(x[i]);
}
__global__ void round_f32_to_bf16(float* y, const float* x, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) y[i] = f32_bf16_rounded(x[i]);
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// A grid-stride loop beyond this many blocks: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;

// The grid for `steps` steps of one thread each (at least one block: the tail's).
dim3 grid_for(int64_t steps) {
  return dim3(unsigned(std::clamp<int64_t>((steps + kBlock - 1) / kBlock, 1, kMaxBlocks)));
}
bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
}  // namespace

void cast_f32_to_bf16(void* stream, bf16* y, const float* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[cast_f32_to_bf16] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;  // a grid of no blocks is a launch error
  static_assert(sizeof(bf16) == sizeof(uint16_t), "bf16 must be its 16 raw bits");
  uint16_t* y16 = reinterpret_cast<uint16_t*>(y);
  if (aligned16(x)) {
    launch("cast_f32_to_bf16_vec", kernels::cast_f32_to_bf16_vec, grid_for(n / 4),
           dim3(unsigned(kBlock)), 0, stream, y16, x, n);
  } else {
    launch("cast_f32_to_bf16", kernels::cast_f32_to_bf16, grid_for(n), dim3(unsigned(kBlock)), 0,
           stream, y16, x, n);
  }
}

void cast_bf16_to_f32(void* stream, float* y, const bf16* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[cast_bf16_to_f32] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
  if (aligned16(x) && aligned16(y)) {
    launch("cast_bf16_to_f32_vec", kernels::cast_bf16_to_f32_vec, grid_for(n / 8),
           dim3(unsigned(kBlock)), 0, stream, y, x16, n);
  } else {
    launch("cast_bf16_to_f32", kernels::cast_bf16_to_f32, grid_for(n), dim3(unsigned(kBlock)), 0,
           stream, y, x16, n);
  }
}

void round_f32_to_bf16(void* stream, float* y, const float* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[round_f32_to_bf16] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  if (aligned16(x) && aligned16(y)) {
    launch("round_f32_to_bf16_vec", kernels::round_f32_to_bf16_vec, grid_for(n / 4),
           dim3(unsigned(kBlock)), 0, stream, y, x, n);
  } else {
    launch("round_f32_to_bf16", kernels::round_f32_to_bf16, grid_for(n), dim3(unsigned(kBlock)), 0,
           stream, y, x, n);
  }
}

}  // namespace moecore::ops::cuda
