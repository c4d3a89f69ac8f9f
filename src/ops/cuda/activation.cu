// The element-wise MLP activations (GeLU, its tanh form, squared ReLU) on the GPU: a block per row,
// threads striding over F, the element bodies shared with the CPU fast path
// (ops::ActivationFn). The backward's dp (the row's sum of act(h) da) meets in a fixed block tree
// (ops/cuda/reduce.cuh): the same bits run to run, no atomics. The bf16 forms are the same
// kernels writing through ops/cuda/store_bf16.cuh: bitwise the cast of the f32 form's outputs.
// The bf16-h forms (--bf16's kept fc1 output) widen h on load: bitwise the f32-h kernels on it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/activation.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/cuda/store_bf16.cuh"

namespace moecore::ops::cuda {

namespace kernels {
// Out: T, or bf16 bits (uint16_t) / the widened bf16 value (kWide) of an f32 result. H: h's
// element type, T or bf16 bits widened on load.
template <Activation A, typename T, bool kWide, typename Out, typename H>
__global__ void activation_forward(Out* a_NF, const H* h_NF, const T* p_N, int64_t F) {
  const int64_t n = blockIdx.x;
  const H* h = h_NF + n * F;
  Out* a = a_NF + n * F;
  const T p = p_N ? p_N[n] : T(1);
  for (int64_t f = threadIdx.x; f < F; f += blockDim.x)
    a[f] = store<kWide>(ActivationFn<A, T>::f(T(widen(h[f]))) * p, a);
}

// The bf16-h forward with F % 8 == 0 and h 16-byte aligned (so is every row): eight elements a
// step in one 16-byte load. Each element's arithmetic is activation_forward's: bitwise its outputs.
template <Activation A, bool kWide, typename Out>
__global__ void activation_forward_h16_vec(Out* a_NF, const uint16_t* h_NF, const float* p_N,
                                           int64_t F) {
  const int64_t n = blockIdx.x;
  const uint16_t* h = h_NF + n * F;
  Out* a = a_NF + n * F;
  const float p = p_N ? p_N[n] : 1.f;
  for (int64_t f0 = 8 * int64_t(threadIdx.x); f0 < F; f0 += 8 * int64_t(blockDim.x)) {
    float hv[8];
    widen8(hv, h + f0);
    MOE_UNROLL
    for (int i = 0; i < 8; ++i) a[f0 + i] = store<kWide>(ActivationFn<A, float>::f(hv[i]) * p, a);
  }
}

// want_dp: dp_N[n] = the row's sum (dynamic shared memory: blockDim.x / 32 + 1 values of T).
template <Activation A, typename T, bool kWide, typename Out, typename H>
__global__ void activation_backward(Out* dh_NF, T* dp_N, const T* da_NF, const H* h_NF,
                                    const T* p_N, int64_t F, bool want_dp) {
  const int64_t n = blockIdx.x;
  const H* h = h_NF + n * F;
  const T* da = da_NF + n * F;
  Out* dh = dh_NF + n * F;
  const T p = p_N ? p_N[n] : T(1);
  T part = 0;
  for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
    const T hf = widen(h[f]);
    dh[f] = store<kWide>(da[f] * p * ActivationFn<A, T>::df(hf), dh);
    if (want_dp) part += ActivationFn<A, T>::f(hf) * da[f];
  }
  if (!want_dp) return;  // uniform over the block: no thread waits at the barriers below
  const T dp = block_sum(part, dynamic_shared<T>());
  if (threadIdx.x == 0) dp_N[n] = dp;
}
}  // namespace kernels

namespace {
// Threads per block: a warp per 32 elements up to 8 warps.
constexpr int64_t kMaxBlock = 256;

void check_shape(const char* op, int64_t N, int64_t F) {
  MOE_KERNEL_CHECK(N >= 0 && N <= 0x7fffffff && F >= 0,
                   std::string("[") + op + "] rows=" + std::to_string(N) +
                       " (0 to 2^31-1, one block each), F=" + std::to_string(F) + " (>= 0)");
}

int64_t block_for(int64_t F) {
  return std::min(kMaxBlock, std::max<int64_t>(32, (F + 31) / 32 * 32));
}

template <Activation A, bool kWide, typename T, typename Out, typename H>
void forward(void* stream, Out* a_NF, const H* h_NF, const T* p_N, int64_t N, int64_t F) {
  if constexpr (std::is_same_v<H, uint16_t>) {
    if (F % 8 == 0 && reinterpret_cast<uintptr_t>(h_NF) % 16 == 0) {
      return launch("activation_forward_h16_vec", kernels::activation_forward_h16_vec<A, kWide, Out>,
                    dim3(unsigned(N)), dim3(unsigned(block_for(F / 8))), 0, stream, a_NF, h_NF,
                    p_N, F);
    }
  }
  launch("activation_forward", kernels::activation_forward<A, T, kWide, Out, H>, dim3(unsigned(N)),
         dim3(unsigned(block_for(F))), 0, stream, a_NF, h_NF, p_N, F);
}

template <Activation A, bool kWide, typename T, typename Out, typename H>
void backward(void* stream, Out* dh_NF, T* dp_N, const T* da_NF, const H* h_NF, const T* p_N,
              int64_t N, int64_t F, bool want_dp) {
  const int64_t block = block_for(F);
  const size_t smem = want_dp ? size_t(block / 32 + 1) * sizeof(T) : 0;
  launch("activation_backward", kernels::activation_backward<A, T, kWide, Out, H>, dim3(unsigned(N)),
         dim3(unsigned(block)), smem, stream, dh_NF, dp_N, da_NF, h_NF, p_N, F, want_dp);
}


// The three forms of each: Out = T, or bf16 bits, or (kWide) the widened bf16 value.
template <bool kWide, typename T, typename Out, typename H>
void forward_any(const char* op, void* stream, Activation act, Out* a_NF, const H* h_NF,
                 const T* p_N, int64_t N, int64_t F) {
  check_elementwise_activation(act, op);
  check_shape(op, N, F);
  if (N == 0 || F == 0) return;  // nothing to write
  switch (act) {
    case Activation::GeLU:
      return forward<Activation::GeLU, kWide>(stream, a_NF, h_NF, p_N, N, F);
    case Activation::GeLUTanh:
      return forward<Activation::GeLUTanh, kWide>(stream, a_NF, h_NF, p_N, N, F);
    case Activation::SquaredReLU:
      return forward<Activation::SquaredReLU, kWide>(stream, a_NF, h_NF, p_N, N, F);
    case Activation::SwiGLU:
      break;
  }
}

template <bool kWide, typename T, typename Out, typename H>
void backward_any(const char* op, void* stream, Activation act, Out* dh_NF, T* dp_N,
                  const T* da_NF, const H* h_NF, const T* p_N, int64_t N, int64_t F) {
  check_elementwise_activation(act, op);
  check_shape(op, N, F);
  const bool want_dp = p_N != nullptr && dp_N != nullptr;
  if (N == 0 || (F == 0 && !want_dp)) return;  // nothing to write (F = 0: dp an empty sum, 0)
  switch (act) {
    case Activation::GeLU:
      return backward<Activation::GeLU, kWide>(stream, dh_NF, dp_N, da_NF, h_NF, p_N, N, F,
                                               want_dp);
    case Activation::GeLUTanh:
      return backward<Activation::GeLUTanh, kWide>(stream, dh_NF, dp_N, da_NF, h_NF, p_N, N, F,
                                                   want_dp);
    case Activation::SquaredReLU:
      return backward<Activation::SquaredReLU, kWide>(stream, dh_NF, dp_N, da_NF, h_NF, p_N, N, F,
                                                      want_dp);
    case Activation::SwiGLU:
      break;
  }
}
}  // namespace

template <typename T>
void activation_forward(void* stream, Activation act, T* a_NF, const T* h_NF, const T* p_N,
                        int64_t N, int64_t F) {
  forward_any<false>("activation_forward", stream, act, a_NF, h_NF, p_N, N, F);
}

template <typename T>
void activation_backward(void* stream, Activation act, T* dh_NF, T* dp_N, const T* da_NF,
                         const T* h_NF, const T* p_N, int64_t N, int64_t F) {
  backward_any<false>("activation_backward", stream, act, dh_NF, dp_N, da_NF, h_NF, p_N, N, F);
}

void activation_forward_bf16(void* stream, Activation act, bf16* a16_NF, const float* h_NF,
                             const float* p_N, int64_t N, int64_t F) {
  forward_any<false>("activation_forward_bf16", stream, act,
                     reinterpret_cast<uint16_t*>(a16_NF), h_NF, p_N, N, F);
}
void activation_backward_bf16(void* stream, Activation act, bf16* dh16_NF, float* dp_N,
                              const float* da_NF, const float* h_NF, const float* p_N, int64_t N,
                              int64_t F) {
  backward_any<false>("activation_backward_bf16", stream, act,
                      reinterpret_cast<uint16_t*>(dh16_NF), dp_N, da_NF, h_NF, p_N, N, F);
}
void activation_forward_bf16w(void* stream, Activation act, float* a_NF, const float* h_NF,
                              const float* p_N, int64_t N, int64_t F) {
  forward_any<true>("activation_forward_bf16w", stream, act, a_NF, h_NF, p_N, N, F);
}
void activation_backward_bf16w(void* stream, Activation act, float* dh_NF, float* dp_N,
                               const float* da_NF, const float* h_NF, const float* p_N, int64_t N,
                               int64_t F) {
  backward_any<true>("activation_backward_bf16w", stream, act, dh_NF, dp_N, da_NF, h_NF, p_N, N,
                     F);
}

// h kept in bf16: the same launches, h's bits widened on load.
namespace {
const uint16_t* bits(const bf16* h) { return reinterpret_cast<const uint16_t*>(h); }
}  // namespace

void activation_forward_bf16(void* stream, Activation act, bf16* a16_NF, const bf16* h16_NF,
                             const float* p_N, int64_t N, int64_t F) {
  forward_any<false>("activation_forward_bf16", stream, act, reinterpret_cast<uint16_t*>(a16_NF),
                     bits(h16_NF), p_N, N, F);
}
void activation_forward_bf16w(void* stream, Activation act, float* a_NF, const bf16* h16_NF,
                              const float* p_N, int64_t N, int64_t F) {
  forward_any<true>("activation_forward_bf16w", stream, act, a_NF, bits(h16_NF), p_N, N, F);
}
void activation_backward(void* stream, Activation act, float* dh_NF, float* dp_N,
                         const float* da_NF, const bf16* h16_NF, const float* p_N, int64_t N,
                         int64_t F) {
  backward_any<false>("activation_backward", stream, act, dh_NF, dp_N, da_NF, bits(h16_NF), p_N,
                      N, F);
}
void activation_backward_bf16(void* stream, Activation act, bf16* dh16_NF, float* dp_N,
                              const float* da_NF, const bf16* h16_NF, const float* p_N, int64_t N,
                              int64_t F) {
  backward_any<false>("activation_backward_bf16", stream, act,
                      reinterpret_cast<uint16_t*>(dh16_NF), dp_N, da_NF, bits(h16_NF), p_N, N, F);
}
void activation_backward_bf16w(void* stream, Activation act, float* dh_NF, float* dp_N,
                               const float* da_NF, const bf16* h16_NF, const float* p_N, int64_t N,
                               int64_t F) {
  backward_any<true>("activation_backward_bf16w", stream, act, dh_NF, dp_N, da_NF, bits(h16_NF),
                     p_N, N, F);
}

template void activation_forward<float>(void*, Activation, float*, const float*, const float*,
                                        int64_t, int64_t);
template void activation_forward<double>(void*, Activation, double*, const double*, const double*,
                                         int64_t, int64_t);
template void activation_backward<float>(void*, Activation, float*, float*, const float*,
                                         const float*, const float*, int64_t, int64_t);
template void activation_backward<double>(void*, Activation, double*, double*, const double*,
                                          const double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
