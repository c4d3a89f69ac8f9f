// RoPE on the GPU: a thread per rotated pair (x[i], x[i + D/2]) of a token's head, grid-stride.
// It reads the f64 cos / sin tables of RopeCache (device memory, filled once by make_rope_cache)
// at the token's position, casts them to T as the CPU path does and rotates with the CPU path's
// explicit operations (a rounded product, then a fused multiply-add; nothing left for the
// compiler to contract): bitwise the CPU fast path. A position
// outside the cache [0, max_pos), which the CPU path refuses on the host, gives NaN (the
// positions are device memory, read only inside the kernel).
#include <algorithm>
#include <limits>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/rounding.cuh"
#include "ops/rope.h"

namespace moecore::ops::cuda {

namespace kernels {
// sign +1: rotation by +angle (forward); -1: by -angle (the backward, the transpose). y may
// alias x: each thread reads its pair before writing it.
template <typename T>
__global__ void rope_rotate(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                            int64_t D, int64_t max_pos, const double* cos_PD, const double* sin_PD,
                            T sign) {
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
    const T c = static_cast<T>(cos_PD[p * half + i]);
    const T s = sign * static_cast<T>(sin_PD[p * half + i]);  // exact: a sign flip
    const T x1 = xh[i], x2 = xh[i + half];
    yh[i] = fma_rn(x1, c, -mul_rn(x2, s));  // x1 c - x2 s
    yh[i + half] = fma_rn(x2, c, mul_rn(x1, s));
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256, kMaxBlocks = 4096;

template <typename T>
void rope_launch(const char* op, void* stream, T* y, const T* x, const int32_t* pos_T,
                 int64_t n_tok, int64_t n_heads, const RopeCache& cache, T sign) {
  MOE_KERNEL_CHECK(cache.D > 0 && cache.D % 2 == 0 && cache.max_pos > 0 &&
                       cache.cos_PD != nullptr && cache.sin_PD != nullptr,
                   std::string("[") + op + "] cache not built (D=" + std::to_string(cache.D) +
                       ", max_pos=" + std::to_string(cache.max_pos) + ", tables " +
                       std::string(cache.cos_PD != nullptr ? "set" : "missing") +
                       "): use make_rope_cache or RopeTables");
  MOE_KERNEL_CHECK(n_tok >= 0 && n_heads >= 0,
                   std::string("[") + op + "] negative size n_tok=" + std::to_string(n_tok) +
                       " n_heads=" + std::to_string(n_heads));
  const int64_t n = n_tok * n_heads * (cache.D / 2);
  if (n == 0) return;
  const int64_t blocks = std::min(kMaxBlocks, (n + kBlock - 1) / kBlock);
  launch(op, kernels::rope_rotate<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0, stream, y,
         x, pos_T, n_tok, n_heads, cache.D, cache.max_pos, raw_ptr(cache.cos_PD),
         raw_ptr(cache.sin_PD), sign);
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
