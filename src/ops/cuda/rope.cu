// RoPE on the GPU: a thread per rotated pair (x[i], x[i + D/2]) of a token's head, grid-stride.
// The f64 cos / sin table of RopeCache lives in host memory, so the kernel computes each angle
// itself with the expression of make_rope_cache (f64 pow, cos, sin): no table to stage and no
// index to bound. Within the dtype's tolerance of the reference (the device's f64 libm may differ
// from the host's in the last ulp, and the rotation may contract into FMAs), not bitwise. A
// position outside the cache [0, max_pos), which the CPU path refuses on the host, gives NaN (the
// positions are device memory, read only inside the kernel).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/rope.h"

namespace moecore::ops::cuda {

namespace kernels {
// sign +1: rotation by +angle (forward); -1: by -angle (the backward, the transpose). y may
// alias x: each thread reads its pair before writing it.
template <typename T>
__global__ void rope_rotate(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                            int64_t D, int64_t max_pos, double base, T sign) {
  const int64_t half = D / 2, n = n_tok * n_heads * half;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t th = e / half, i = e % half, t = th / n_heads;
    const T* xh = x + th * D;
    T* yh = y + th * D;
    const int64_t p = pos_T[t];
    if (p < 0 || p >= max_pos) {
      yh[i] = yh[i + half] = std::numeric_limits<T>::quiet_NaN();
      continue;
    }
    const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    const double angle = static_cast<double>(p) * inv_freq;
    const T c = static_cast<T>(std::cos(angle)), s = sign * static_cast<T>(std::sin(angle));
    const T x1 = xh[i], x2 = xh[i + half];
    yh[i] = x1 * c - x2 * s;
    yh[i + half] = x2 * c + x1 * s;
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256, kMaxBlocks = 4096;

template <typename T>
void rope_launch(const char* op, void* stream, T* y, const T* x, const int32_t* pos_T,
                 int64_t n_tok, int64_t n_heads, const RopeCache& cache, T sign) {
  MOE_KERNEL_CHECK(cache.D > 0 && cache.D % 2 == 0 && cache.max_pos > 0 && cache.base > 0,
                   "[" + std::string(op) + "] cache not built (D=" + std::to_string(cache.D) +
                       ", max_pos=" + std::to_string(cache.max_pos) +
                       ", base=" + std::to_string(cache.base) + "): use make_rope_cache");
  MOE_KERNEL_CHECK(n_tok >= 0 && n_heads >= 0,
                   "[" + std::string(op) + "] negative size n_tok=" + std::to_string(n_tok) +
                       " n_heads=" + std::to_string(n_heads));
  const int64_t n = n_tok * n_heads * (cache.D / 2);
  if (n == 0) return;
  const int64_t blocks = std::min(kMaxBlocks, (n + kBlock - 1) / kBlock);
  launch(op, kernels::rope_rotate<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0, stream, y,
         x, pos_T, n_tok, n_heads, cache.D, cache.max_pos, cache.base, sign);
}
}  // namespace

template <typename T>
void rope_forward(void* stream, T* y, const T* x, const int32_t* pos_T, int64_t n_tok,
                  int64_t n_heads, const RopeCache& cache) {
  rope_launch("rope_forward", stream, y, x, pos_T, n_tok, n_heads, cache, T(1));
}

template <typename T>
void rope_backward(void* stream, T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok,
                   int64_t n_heads, const RopeCache& cache) {
  rope_launch("rope_backward", stream, dx, dy, pos_T, n_tok, n_heads, cache, T(-1));
}

#define MOECORE_INSTANTIATE_ROPE_CUDA(T)                                                \
  template void rope_forward<T>(void*, T*, const T*, const int32_t*, int64_t, int64_t,  \
                                const RopeCache&);                                      \
  template void rope_backward<T>(void*, T*, const T*, const int32_t*, int64_t, int64_t, \
                                 const RopeCache&);
MOECORE_INSTANTIATE_ROPE_CUDA(float)
MOECORE_INSTANTIATE_ROPE_CUDA(double)
#undef MOECORE_INSTANTIATE_ROPE_CUDA

}  // namespace moecore::ops::cuda
