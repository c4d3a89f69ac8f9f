// Products and sums rounded one at a time, as the CPU rounds them: nvcc contracts a * b + c into
// one FMA by default (GCC in ISO C++ mode does not), so a kernel that promises the CPU's bits, or
// keeps a rounded value consistent within one expression, spells its products with these.
#pragma once

#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

__device__ __forceinline__ float mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ double mul_rn(double a, double b) {
  return __dmul_rn(a, b);
}
// a * b + c with one rounding (the CPU path's std::fma).
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  return __fmaf_rn(a, b, c);
}
__device__ __forceinline__ double fma_rn(double a, double b, double c) {
  return __fma_rn(a, b, c);
}
__device__ __forceinline__ float add_rn(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ double add_rn(double a, double b) {
  return __dadd_rn(a, b);
}

}  // namespace moecore::ops::cuda
