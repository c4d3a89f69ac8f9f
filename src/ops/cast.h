// Conversions between f32 and bf16 (round to nearest even).
#pragma once

#include <bit>
#include <cstdint>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"
#include "core/host_device.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void cast_f32_to_bf16(bf16* y, const float* x, int64_t n);
void cast_bf16_to_f32(float* y, const bf16* x, int64_t n);
void round_f32_to_bf16(float* y, const float* x, int64_t n);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. Not dispatched by the switches below yet. Bitwise the references.
namespace cuda {
void cast_f32_to_bf16(void* stream, bf16* y, const float* x, int64_t n);
void cast_bf16_to_f32(void* stream, float* y, const bf16* x, int64_t n);
void round_f32_to_bf16(void* stream, float* y, const float* x, int64_t n);
}  // namespace cuda

inline void cast_f32_to_bf16(const Exec& ex, DevPtr<bf16> y, DevPtr<const float> x, int64_t n) {
  if (ex.on_cpu()) return cpu::cast_f32_to_bf16(raw_ptr(y), raw_ptr(x), n);
  return cuda::cast_f32_to_bf16(ex.stream, raw_ptr(y), raw_ptr(x), n);
}
void cast_f32_to_bf16_ref(bf16* y, const float* x, int64_t n);
inline void cast_bf16_to_f32(const Exec& ex, DevPtr<float> y, DevPtr<const bf16> x, int64_t n) {
  if (ex.on_cpu()) return cpu::cast_bf16_to_f32(raw_ptr(y), raw_ptr(x), n);
  return cuda::cast_bf16_to_f32(ex.stream, raw_ptr(y), raw_ptr(x), n);
}
void cast_bf16_to_f32_ref(float* y, const bf16* x, int64_t n);
// y = f32(bf16(x)): the bf16 value of x kept in an f32 (the widened-bf16 GEMM path's inputs,
// made in one pass from the f32 source instead of a cast and a widening). y may be x.
inline void round_f32_to_bf16(const Exec& ex, DevPtr<float> y, DevPtr<const float> x, int64_t n) {
  if (ex.on_cpu()) return cpu::round_f32_to_bf16(raw_ptr(y), raw_ptr(x), n);
  return cuda::round_f32_to_bf16(ex.stream, raw_ptr(y), raw_ptr(x), n);
}
void round_f32_to_bf16_ref(float* y, const float* x, int64_t n);

// The bits of float_to_bf16(x) (core/dtype.h), branch-free so that loops calling it vectorise:
// for kernels that write a bf16 copy of what they compute in the same pass (the cross-entropy
// gradient for the bf16 head GEMMs, AdamW's bf16 weight copies). Bitwise equal to the reference.
// The element bodies below are shared by the CPU fast paths and the CUDA kernels.
MOE_HOST_DEVICE inline uint16_t f32_to_bf16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}

// x rounded to bf16 and widened back: the bf16 value as an f32, for the f32 buffers that hold
// bf16 values (the widen GEMM path's inputs and weight copies, bf16-valued outputs).
MOE_HOST_DEVICE inline float f32_bf16_rounded(float x) {
  return std::bit_cast<float>(uint32_t{f32_to_bf16_bits(x)} << 16);
}

// The f32 value of bf16 bits (exact: the bits become the f32's upper half).
MOE_HOST_DEVICE inline float bf16_bits_to_f32(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

}  // namespace moecore::ops
