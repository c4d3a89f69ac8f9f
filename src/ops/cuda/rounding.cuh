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
__device__ __forceinline__ float add_rn(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ double add_rn(double a, double b) {
  return __dadd_rn(a, b);
}

}  // namespace moecore::ops::cuda
