// Rotary position embedding, Megatron's non-interleaved form: with x = [x1 | x2] (halves of the
// head dim D), y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1], angle for pair i
// at position p = p * base^(-2i/D).
#pragma once

#include <cstdint>
#include <vector>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/cuda_kernels.h"

namespace moecore::ops {

// cos/sin tables [max_pos, D/2] in f64, built once before step 0 (host memory: the CUDA kernel
// computes the angles from base instead).
struct RopeCache {
  int64_t max_pos = 0, D = 0;
  double base = 0;
  std::vector<double> cos_PD, sin_PD;
};
RopeCache make_rope_cache(int64_t max_pos, int64_t D, double base);

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void rope_forward(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                  const RopeCache& cache);
template <typename T>
void rope_backward(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                   const RopeCache& cache);
}  // namespace cpu
// The CUDA kernels (ops/cuda/rope.cu): the angles computed in f64 from cache.base, within the
// dtype's tolerance of the reference; a position outside [0, cache.max_pos) gives NaN (the CPU
// path throws). `stream` is the context's.
namespace cuda {
template <typename T>
void rope_forward(void* stream, T* y, const T* x, const int32_t* pos_T, int64_t n_tok,
                  int64_t n_heads, const RopeCache& cache);
template <typename T>
void rope_backward(void* stream, T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok,
                   int64_t n_heads, const RopeCache& cache);
}  // namespace cuda

// x, y [n_tok, n_heads, D]; token t is at position pos_T[t]. y may alias x.
template <typename T>
void rope_forward(const Exec& ex, DevPtr<T> y, DevPtr<const T> x, DevPtr<const int32_t> pos_T,
                  int64_t n_tok, int64_t n_heads, const RopeCache& cache) {
  if (ex.on_cpu())
    return cpu::rope_forward(raw_ptr(y), raw_ptr(x), raw_ptr(pos_T), n_tok, n_heads, cache);
  if constexpr (kHaveCudaKernels)
    return cuda::rope_forward(ex.stream, raw_ptr(y), raw_ptr(x), raw_ptr(pos_T), n_tok, n_heads,
                              cache);
  no_kernel(ex, "rope_forward");
}
template <typename T>
void rope_forward_ref(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                      int64_t D, double base);
// The inverse rotation (the transpose): dx may alias dy.
template <typename T>
void rope_backward(const Exec& ex, DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const int32_t> pos_T,
                   int64_t n_tok, int64_t n_heads, const RopeCache& cache) {
  if (ex.on_cpu())
    return cpu::rope_backward(raw_ptr(dx), raw_ptr(dy), raw_ptr(pos_T), n_tok, n_heads, cache);
  if constexpr (kHaveCudaKernels)
    return cuda::rope_backward(ex.stream, raw_ptr(dx), raw_ptr(dy), raw_ptr(pos_T), n_tok, n_heads,
                               cache);
  no_kernel(ex, "rope_backward");
}
template <typename T>
void rope_backward_ref(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                       int64_t D, double base);

}  // namespace moecore::ops
