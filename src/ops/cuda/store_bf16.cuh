// How the element-wise CUDA kernels write a result whose output may be the working type, bf16
// bits (an f32 result rounded for a bf16 GEMM input) or the bf16 value widened back to f32 (the
// widened-bf16 GEMM path): one kernel template serves the three forms of an op, the f32
// arithmetic the same in each, so the bf16 forms are bitwise the cast of the f32 form's output
// (ops/cast.h's rounding, shared with cast.cu). The GPU twin of ops/cpu/store_bf16.h.
#pragma once

#include <cstdint>

#include "ops/cast.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

// The output element type: T itself, or bf16 bits (uint16_t) of an f32 result.
template <typename T>
__device__ __forceinline__ T store_as(T v, T*) {
  return v;
}
__device__ __forceinline__ uint16_t store_as(float v, uint16_t*) { return f32_to_bf16_bits(v); }
// kWide: an f32 output holding the bf16 value of the result.
template <bool kWide, typename T, typename Out>
__device__ __forceinline__ Out store(T v, Out* p) {
  if constexpr (kWide) {
    return f32_bf16_rounded(v);
  } else {
    return store_as(v, p);
  }
}

// How they read an input that may be the working type or bf16 bits (fc1's output kept in bf16
// under --bf16): widened exactly, so the f32 arithmetic after it is the widen-then-f32 op's.
template <typename T>
__device__ __forceinline__ T widen(T v) {
  return v;
}
__device__ __forceinline__ float widen(uint16_t b) { return bf16_bits_to_f32(b); }
// Eight bf16 at a 16-byte-aligned p, widened, with one 16-byte load (memory-bound kernels reading
// a bf16 input). Each 32-bit word holds two bf16, the lower-addressed one in its low half.
__device__ __forceinline__ void widen8(float (&v)[8], const uint16_t* p) {
  const int4 w = *reinterpret_cast<const int4*>(p);
  const int words[4] = {w.x, w.y, w.z, w.w};
  MOE_UNROLL
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bf16_bits_to_f32(uint16_t(uint32_t(words[i]) & 0xffffu));
    v[2 * i + 1] = bf16_bits_to_f32(uint16_t(uint32_t(words[i]) >> 16));
  }
}
}  // namespace moecore::ops::cuda
