// The numeric guard's ops on the GPU: device-side flags, never read by the host inside the op.
// The non-finite scan is a grid-stride loop in which a thread that meets a NaN or an Inf stores 1
// into the flag; every such store writes the same value, so the result is a yes / no that does
// not depend on the order of the threads (no atomics). The scalar checks run on one thread.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/numeric_guard.h"

namespace moecore::ops::cuda {

namespace kernels {
// x - x is 0 for a finite x and NaN for NaN and +-Inf (the CPU fast path's test).
template <typename T>
__global__ void flag_nonfinite(int32_t* flag, const T* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  bool bad = false;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    bad = bad || !(x[i] - x[i] == T(0));
  if (bad) *flag = 1;
}

__global__ void flag_at_least(int32_t* flag, const double* value, const double* threshold) {
  const double v = std::fabs(*value);
  if (std::isfinite(v) && v >= *threshold) *flag = 1;
}

__global__ void skip_if_flagged(AdamWStep* step, const int32_t* flags, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (flags[i] != 0) {
      step->skip = 1;
      return;
    }
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;  // one H200 wave; threads stride the rest
}  // namespace

template <typename T>
void flag_nonfinite(void* stream, int32_t* flag, const T* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[flag_nonfinite] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  const int64_t blocks = std::min((n + kBlock - 1) / kBlock, kMaxBlocks);
  launch("flag_nonfinite", kernels::flag_nonfinite<T>, dim3(unsigned(blocks)),
         dim3(unsigned(kBlock)), 0, stream, flag, x, n);
}

void flag_at_least(void* stream, int32_t* flag, const double* value, const double* threshold) {
  launch("flag_at_least", kernels::flag_at_least, dim3(1), dim3(1), 0, stream, flag, value,
         threshold);
}

// The flags are few (one per guard): one thread reads them in order.
void skip_if_flagged(void* stream, AdamWStep* step, const int32_t* flags, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[skip_if_flagged] n=" + std::to_string(n) + " < 0");
  if (n == 0) return;
  launch("skip_if_flagged", kernels::skip_if_flagged, dim3(1), dim3(1), 0, stream, step, flags, n);
}

template void flag_nonfinite<float>(void*, int32_t*, const float*, int64_t);
template void flag_nonfinite<double>(void*, int32_t*, const double*, int64_t);

}  // namespace moecore::ops::cuda
