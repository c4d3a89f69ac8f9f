// SwiGLU on the GPU: a block per row (h rows are [gate | up], F each), threads striding over F.
// The backward's dp (the row's sum of silu(g) u da) meets in a fixed block tree (ops/cuda/
// reduce.cuh): the same bits run to run, no atomics. The sigmoid uses the device's exp, not the
// CPU fast path's fast_exp, so the two backends agree within the dtype's tolerance, not bitwise.
// The bf16 forms are the same kernels writing through ops/cuda/store_bf16.cuh: bitwise the cast
// of the f32 form's outputs, dp the f32 form's. The bf16-h forms (--bf16's kept fc1 output) take
// h's element type as a parameter, widening on load: bitwise the f32-h kernels on the widened h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/cuda/store_bf16.cuh"
#include "ops/swiglu.h"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__device__ __forceinline__ T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

// Out: T, or bf16 bits (uint16_t) / the widened bf16 value (kWide) of an f32 result. H: h's
// element type, T or bf16 bits widened on load.
template <typename T, bool kWide, typename Out, typename H>
__global__ void swiglu_forward(Out* a_NF, const H* h_N2F, const T* p_N, int64_t F) {
  const int64_t n = blockIdx.x;
  const H* g = h_N2F + n * 2 * F;
  const H* u = g + F;
  Out* a = a_NF + n * F;
  const T p = p_N ? p_N[n] : T(1);
  for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
    const T gf = widen(g[f]);
    a[f] = store<kWide>(gf * sigmoid(gf) * widen(u[f]) * p, a);
  }
}

// The bf16-h forward with F % 8 == 0 and h 16-byte aligned (so is every row's gate and up):
// eight elements a step, each half's eight bf16 in one 16-byte load. Each element's arithmetic is
// swiglu_forward's, so the outputs are bitwise its.
template <bool kWide, typename Out>
__global__ void swiglu_forward_h16_vec(Out* a_NF, const uint16_t* h_N2F, const float* p_N,
                                       int64_t F) {
  const int64_t n = blockIdx.x;
  const uint16_t* g = h_N2F + n * 2 * F;
  const uint16_t* u = g + F;
  Out* a = a_NF + n * F;
  const float p = p_N ? p_N[n] : 1.f;
  for (int64_t f0 = 8 * int64_t(threadIdx.x); f0 < F; f0 += 8 * int64_t(blockDim.x)) {
    float gv[8], uv[8];
    widen8(gv, g + f0);
    widen8(uv, u + f0);
    MOE_UNROLL
    for (int i = 0; i < 8; ++i) a[f0 + i] = store<kWide>(gv[i] * sigmoid(gv[i]) * uv[i] * p, a);
  }
}

// want_dp: dp_N[n] = the row's sum (dynamic shared memory: blockDim.x / 32 + 1 values of T).
template <typename T, bool kWide, typename Out, typename H>
__global__ void swiglu_backward(Out* dh_N2F, T* dp_N, const T* da_NF, const H* h_N2F, const T* p_N,
                                int64_t F, bool want_dp) {
  const int64_t n = blockIdx.x;
  const H* g = h_N2F + n * 2 * F;
  const H* u = g + F;
  const T* da = da_NF + n * F;
  Out* dg = dh_N2F + n * 2 * F;
  Out* du = dg + F;
  const T p = p_N ? p_N[n] : T(1);
  T part = 0;
  for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
    const T gf = widen(g[f]), uf = widen(u[f]);
    const T s = sigmoid(gf);
    const T silu = gf * s;
    dg[f] = store<kWide>(da[f] * p * uf * s * (T(1) + gf * (T(1) - s)), dg);
    du[f] = store<kWide>(da[f] * p * silu, du);
    part += silu * uf * da[f];
  }
  if (!want_dp) return;  // uniform over the block: no thread waits at the barriers below
  const T dp = block_sum(part, dynamic_shared<T>());
  if (threadIdx.x == 0) dp_N[n] = dp;
}
}  // namespace kernels

namespace {
// Threads per block: a warp per 32 elements up to 8 warps.
constexpr int64_t kMaxBlock = 256;

std::string shape(int64_t N, int64_t F) {
  return "rows=" + std::to_string(N) + " (0 to 2^31-1, one block each), F=" + std::to_string(F) +
         " (>= 0)";
}


// The three forms of each: Out = T, or bf16 bits, or (kWide) the widened bf16 value.
template <bool kWide, typename T, typename Out, typename H>
void forward_any(const char* op, void* stream, Out* a_NF, const H* h_N2F, const T* p_N, int64_t N,
                 int64_t F) {
  MOE_KERNEL_CHECK(N >= 0 && N <= 0x7fffffff && F >= 0, std::string("[") + op + "] " + shape(N, F));
  if (N == 0 || F == 0) return;  // nothing to write
  if constexpr (std::is_same_v<H, uint16_t>) {
    if (F % 8 == 0 && reinterpret_cast<uintptr_t>(h_N2F) % 16 == 0) {
      const int64_t block = std::min(kMaxBlock, (F / 8 + 31) / 32 * 32);
      return launch("swiglu_forward_h16_vec", kernels::swiglu_forward_h16_vec<kWide, Out>,
                    dim3(unsigned(N)), dim3(unsigned(block)), 0, stream, a_NF, h_N2F, p_N, F);
    }
  }
  const int64_t block = std::min(kMaxBlock, (F + 31) / 32 * 32);
  launch("swiglu_forward", kernels::swiglu_forward<T, kWide, Out, H>, dim3(unsigned(N)),
         dim3(unsigned(block)), 0, stream, a_NF, h_N2F, p_N, F);
}

template <bool kWide, typename T, typename Out, typename H>
void backward_any(const char* op, void* stream, Out* dh_N2F, T* dp_N, const T* da_NF,
                  const H* h_N2F, const T* p_N, int64_t N, int64_t F) {
  MOE_KERNEL_CHECK(N >= 0 && N <= 0x7fffffff && F >= 0, std::string("[") + op + "] " + shape(N, F));
  if (N == 0) return;
  const bool want_dp = p_N != nullptr && dp_N != nullptr;
  if (F == 0 && !want_dp) return;  // nothing to write (with F = 0, dp is an empty sum: 0)
  const int64_t block = std::min(kMaxBlock, std::max<int64_t>(32, (F + 31) / 32 * 32));
  const size_t smem = want_dp ? size_t(block / 32 + 1) * sizeof(T) : 0;
  launch("swiglu_backward", kernels::swiglu_backward<T, kWide, Out, H>, dim3(unsigned(N)),
         dim3(unsigned(block)), smem, stream, dh_N2F, dp_N, da_NF, h_N2F, p_N, F, want_dp);
}
}  // namespace

template <typename T>
void swiglu_forward(void* stream, T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F) {
  forward_any<false>("swiglu_forward", stream, a_NF, h_N2F, p_N, N, F);
}

template <typename T>
void swiglu_backward(void* stream, T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N,
                     int64_t N, int64_t F) {
  backward_any<false>("swiglu_backward", stream, dh_N2F, dp_N, da_NF, h_N2F, p_N, N, F);
}

void swiglu_forward_bf16(void* stream, bf16* a16_NF, const float* h_N2F, const float* p_N,
                         int64_t N, int64_t F) {
  forward_any<false>("swiglu_forward_bf16", stream, reinterpret_cast<uint16_t*>(a16_NF), h_N2F,
                     p_N, N, F);
}
void swiglu_backward_bf16(void* stream, bf16* dh16_N2F, float* dp_N, const float* da_NF,
                          const float* h_N2F, const float* p_N, int64_t N, int64_t F) {
  backward_any<false>("swiglu_backward_bf16", stream, reinterpret_cast<uint16_t*>(dh16_N2F), dp_N,
                      da_NF, h_N2F, p_N, N, F);
}
void swiglu_forward_bf16w(void* stream, float* a_NF, const float* h_N2F, const float* p_N,
                          int64_t N, int64_t F) {
  forward_any<true>("swiglu_forward_bf16w", stream, a_NF, h_N2F, p_N, N, F);
}
void swiglu_backward_bf16w(void* stream, float* dh_N2F, float* dp_N, const float* da_NF,
                           const float* h_N2F, const float* p_N, int64_t N, int64_t F) {
  backward_any<true>("swiglu_backward_bf16w", stream, dh_N2F, dp_N, da_NF, h_N2F, p_N, N, F);
}

// h kept in bf16: the same launches, h's bits widened on load.
namespace {
const uint16_t* bits(const bf16* h) { return reinterpret_cast<const uint16_t*>(h); }
}  // namespace

void swiglu_forward_bf16(void* stream, bf16* a16_NF, const bf16* h16_N2F, const float* p_N,
                         int64_t N, int64_t F) {
  forward_any<false>("swiglu_forward_bf16", stream, reinterpret_cast<uint16_t*>(a16_NF),
                     bits(h16_N2F), p_N, N, F);
}
void swiglu_forward_bf16w(void* stream, float* a_NF, const bf16* h16_N2F, const float* p_N,
                          int64_t N, int64_t F) {
  forward_any<true>("swiglu_forward_bf16w", stream, a_NF, bits(h16_N2F), p_N, N, F);
}
void swiglu_backward(void* stream, float* dh_N2F, float* dp_N, const float* da_NF,
                     const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F) {
  backward_any<false>("swiglu_backward", stream, dh_N2F, dp_N, da_NF, bits(h16_N2F), p_N, N, F);
}
void swiglu_backward_bf16(void* stream, bf16* dh16_N2F, float* dp_N, const float* da_NF,
                          const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F) {
  backward_any<false>("swiglu_backward_bf16", stream, reinterpret_cast<uint16_t*>(dh16_N2F), dp_N,
                      da_NF, bits(h16_N2F), p_N, N, F);
}
void swiglu_backward_bf16w(void* stream, float* dh_N2F, float* dp_N, const float* da_NF,
                           const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F) {
  backward_any<true>("swiglu_backward_bf16w", stream, dh_N2F, dp_N, da_NF, bits(h16_N2F), p_N, N,
                     F);
}

template void swiglu_forward<float>(void*, float*, const float*, const float*, int64_t, int64_t);
template void swiglu_forward<double>(void*, double*, const double*, const double*, int64_t,
                                     int64_t);
template void swiglu_backward<float>(void*, float*, float*, const float*, const float*,
                                     const float*, int64_t, int64_t);
template void swiglu_backward<double>(void*, double*, double*, const double*, const double*,
                                      const double*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
