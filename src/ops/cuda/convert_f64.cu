// Conversions between the model dtype and f64 on the GPU (the router's f64 math): grid-stride
// loops, each element one rounding (widen, narrow, an f64 y's fused multiply-add) or the f32
// form's f64 product narrowed and added, as the references: bitwise theirs.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ops/convert_f64.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void widen_to_f64(double* y, const T* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = static_cast<double>(x[i]);
}
template <typename T>
__global__ void narrow_from_f64(T* y, const double* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = static_cast<T>(x[i]);
}
// factor null: y += T(x). T = double: one explicit fused multiply-add (the op's one rounding).
template <typename T>
__global__ void add_from_f64(T* y, const double* x, const T* factor, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (std::is_same_v<T, double>) {
      y[i] = factor ? __fma_rn(x[i], factor[i], y[i]) : y[i] + x[i];
    } else {
      const double v = factor ? x[i] * static_cast<double>(factor[i]) : x[i];
      y[i] += static_cast<T>(v);
    }
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// A grid of at most one H200 wave; the threads stride over the rest.
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;

dim3 grid_for(int64_t n) {
  return dim3(unsigned(std::min((n + kBlock - 1) / kBlock, kMaxBlocks)));
}
void check_n(const char* op, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, std::string("[") + op + "] n=" + std::to_string(n) + " < 0");
}
}  // namespace

template <typename T>
void widen_to_f64(void* stream, double* y, const T* x, int64_t n) {
  check_n("widen_to_f64", n);
  if (n == 0) return;
  launch("widen_to_f64", kernels::widen_to_f64<T>, grid_for(n), dim3(unsigned(kBlock)), 0, stream,
         y, x, n);
}

template <typename T>
void narrow_from_f64(void* stream, T* y, const double* x, int64_t n) {
  check_n("narrow_from_f64", n);
  if (n == 0) return;
  launch("narrow_from_f64", kernels::narrow_from_f64<T>, grid_for(n), dim3(unsigned(kBlock)), 0,
         stream, y, x, n);
}

template <typename T>
void add_from_f64(void* stream, T* y, const double* x, const T* factor, int64_t n) {
  check_n("add_from_f64", n);
  if (n == 0) return;
  launch("add_from_f64", kernels::add_from_f64<T>, grid_for(n), dim3(unsigned(kBlock)), 0, stream,
         y, x, factor, n);
}

template void widen_to_f64<float>(void*, double*, const float*, int64_t);
template void widen_to_f64<double>(void*, double*, const double*, int64_t);
template void narrow_from_f64<float>(void*, float*, const double*, int64_t);
template void narrow_from_f64<double>(void*, double*, const double*, int64_t);
template void add_from_f64<float>(void*, float*, const double*, const float*, int64_t);
template void add_from_f64<double>(void*, double*, const double*, const double*, int64_t);

}  // namespace moecore::ops::cuda
