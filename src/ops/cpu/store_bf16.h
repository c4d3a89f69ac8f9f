// How the element-wise CPU kernels write a result whose output may be the working type, bf16
// bits (an f32 result rounded for a bf16 GEMM input) or the bf16 value widened back to f32 (the
// widened-bf16 GEMM path): one template serves the three forms of an op (ops/swiglu.h).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "ops/cast.h"

namespace moecore::ops::cpu {

// The output element type: T itself, or bf16 bits (uint16_t) of an f32 result.
template <typename T>
inline T store_as(T v, T*) {
  return v;
}
inline uint16_t store_as(float v, uint16_t*) { return f32_to_bf16_bits(v); }
// kWide: an f32 output holding the bf16 value of the result.
template <bool kWide, typename T, typename Out>
inline Out store(T v, Out* p) {
  if constexpr (kWide) {
    return f32_bf16_rounded(v);
  } else {
    return store_as(v, p);
  }
}

// How they read an input that may be the working type or bf16 bits (fc1's output kept in bf16
// under --bf16): widened exactly, so the f32 arithmetic after it is the widen-then-f32 op's.
template <typename T>
inline T widen(T v) {
  return v;
}
inline float widen(uint16_t b) { return bf16_bits_to_f32(b); }
inline float widen(bf16 v) { return bf16_to_float(v); }
}  // namespace moecore::ops::cpu
