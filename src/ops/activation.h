// The MLP activations Megatron offers (--swiglu, the default GeLU, --openai-gelu,
// --squared-relu). SwiGLU is gated: fc1 writes [gate | up] rows of 2F and ops/swiglu.h computes
// it; the others act element by element on F columns, here, with the per-row routing prob of
// MOE_SEMANTICS as swiglu has it: a = act(h) * p (p null: 1).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"
#include "core/host_device.h"

namespace moecore::ops {

enum class Activation : uint8_t {
  SwiGLU,       // silu(gate) * up (--swiglu)
  GeLU,         // exact: 0.5 x (1 + erf(x / sqrt 2)), Megatron's default
  GeLUTanh,     // the tanh form GPT-2 uses (--openai-gelu, HF's gelu_new)
  SquaredReLU,  // max(x, 0)^2 (--squared-relu)
};

// Whether fc1 writes two halves (gate and up) per row.
constexpr bool activation_gated(Activation a) {
  return a == Activation::SwiGLU;
}
// fc1's output width for an MLP of width F.
constexpr int64_t activation_fc1_width(Activation a, int64_t F) {
  return activation_gated(a) ? 2 * F : F;
}
// "swiglu", "gelu", "openai_gelu", "squared_relu": the names logs and docs use.
constexpr const char* activation_name(Activation a) {
  switch (a) {
    case Activation::SwiGLU:
      return "swiglu";
    case Activation::GeLU:
      return "gelu";
    case Activation::GeLUTanh:
      return "openai_gelu";
    case Activation::SquaredReLU:
      return "squared_relu";
  }
  return "?";
}

// The element-wise (non-gated) activations below refuse SwiGLU (it reads two halves per row:
// ops/swiglu.h), naming the op.
void check_elementwise_activation(Activation act, const char* op);

// act(x) and act'(x) in T: the element bodies of the CPU fast path and the CUDA kernels (never of
// the _ref). The constants are Megatron's (openai_gelu: 0.7978845608028654 = sqrt(2 / pi),
// 0.044715) and F.gelu's exact form.
template <Activation A, typename T>
struct ActivationFn;
template <typename T>
struct ActivationFn<Activation::GeLU, T> {
  MOE_HOST_DEVICE static T f(T x) {
    return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440)));
  }
  MOE_HOST_DEVICE static T df(T x) {
    const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
    const T pdf = T(0.39894228040143267794) * std::exp(T(-0.5) * x * x);
    return cdf + x * pdf;
  }
};
template <typename T>
struct ActivationFn<Activation::GeLUTanh, T> {
  MOE_HOST_DEVICE static T f(T x) {
    return T(0.5) * x * (T(1) + std::tanh(T(0.7978845608028654) * (x + T(0.044715) * x * x * x)));
  }
  MOE_HOST_DEVICE static T df(T x) {
    const T t = std::tanh(T(0.7978845608028654) * (x + T(0.044715) * x * x * x));
    return T(0.5) * (T(1) + t) +
           T(0.5) * x * (T(1) - t * t) * T(0.7978845608028654) * (T(1) + T(3 * 0.044715) * x * x);
  }
};
template <typename T>
struct ActivationFn<Activation::SquaredReLU, T> {
  MOE_HOST_DEVICE static T f(T x) { return x > T(0) ? x * x : T(0); }
  MOE_HOST_DEVICE static T df(T x) { return x > T(0) ? T(2) * x : T(0); }
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void activation_forward(Activation act, T* a_NF, const T* h_NF, const T* p_N, int64_t N, int64_t F);
template <typename T>
void activation_backward(Activation act, T* dh_NF, T* dp_N, const T* da_NF, const T* h_NF,
                         const T* p_N, int64_t N, int64_t F);
void activation_forward_bf16(Activation act, bf16* a16_NF, const float* h_NF, const float* p_N,
                             int64_t N, int64_t F);
void activation_backward_bf16(Activation act, bf16* dh16_NF, float* dp_N, const float* da_NF,
                              const float* h_NF, const float* p_N, int64_t N, int64_t F);
void activation_forward_bf16w(Activation act, float* a_NF, const float* h_NF, const float* p_N,
                              int64_t N, int64_t F);
void activation_backward_bf16w(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                               const float* h_NF, const float* p_N, int64_t N, int64_t F);
// h kept in bf16 (the forms below that take a bf16 h).
void activation_forward_bf16(Activation act, bf16* a16_NF, const bf16* h16_NF, const float* p_N,
                             int64_t N, int64_t F);
void activation_forward_bf16w(Activation act, float* a_NF, const bf16* h16_NF, const float* p_N,
                              int64_t N, int64_t F);
void activation_backward(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                         const bf16* h16_NF, const float* p_N, int64_t N, int64_t F);
void activation_backward_bf16(Activation act, bf16* dh16_NF, float* dp_N, const float* da_NF,
                              const bf16* h16_NF, const float* p_N, int64_t N, int64_t F);
void activation_backward_bf16w(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                               const bf16* h16_NF, const float* p_N, int64_t N, int64_t F);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. dp's sum over a row in a fixed
// block tree (not the CPU's lanes: within the dtype's tolerance of it, bitwise run to run).
namespace cuda {
template <typename T>
void activation_forward(void* stream, Activation act, T* a_NF, const T* h_NF, const T* p_N,
                        int64_t N, int64_t F);
template <typename T>
void activation_backward(void* stream, Activation act, T* dh_NF, T* dp_N, const T* da_NF,
                         const T* h_NF, const T* p_N, int64_t N, int64_t F);
// The bf16 forms: the same kernels writing bf16 bits or their widened values (bitwise the casts).
void activation_forward_bf16(void* stream, Activation act, bf16* a16_NF, const float* h_NF,
                             const float* p_N, int64_t N, int64_t F);
void activation_backward_bf16(void* stream, Activation act, bf16* dh16_NF, float* dp_N,
                              const float* da_NF, const float* h_NF, const float* p_N, int64_t N,
                              int64_t F);
void activation_forward_bf16w(void* stream, Activation act, float* a_NF, const float* h_NF,
                              const float* p_N, int64_t N, int64_t F);
void activation_backward_bf16w(void* stream, Activation act, float* dh_NF, float* dp_N,
                               const float* da_NF, const float* h_NF, const float* p_N, int64_t N,
                               int64_t F);
// h kept in bf16: the same kernels, h widened on load (the forwards load 16 bytes of h a step
// when F % 8 == 0 and h is 16-byte aligned; the backwards one element a step, the order dp's
// block tree sums in).
void activation_forward_bf16(void* stream, Activation act, bf16* a16_NF, const bf16* h16_NF,
                             const float* p_N, int64_t N, int64_t F);
void activation_forward_bf16w(void* stream, Activation act, float* a_NF, const bf16* h16_NF,
                              const float* p_N, int64_t N, int64_t F);
void activation_backward(void* stream, Activation act, float* dh_NF, float* dp_N,
                         const float* da_NF, const bf16* h16_NF, const float* p_N, int64_t N,
                         int64_t F);
void activation_backward_bf16(void* stream, Activation act, bf16* dh16_NF, float* dp_N,
                              const float* da_NF, const bf16* h16_NF, const float* p_N, int64_t N,
                              int64_t F);
void activation_backward_bf16w(void* stream, Activation act, float* dh_NF, float* dp_N,
                               const float* da_NF, const bf16* h16_NF, const float* p_N, int64_t N,
                               int64_t F);
}  // namespace cuda

// a = act(h) * p, h and a [N, F].
template <typename T>
void activation_forward(const Exec& ex, Activation act, DevPtr<T> a_NF, DevPtr<const T> h_NF,
                        DevPtr<const T> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_forward(act, raw_ptr(a_NF), raw_ptr(h_NF), raw_ptr(p_N), N, F);
  return cuda::activation_forward(ex.stream, act, raw_ptr(a_NF), raw_ptr(h_NF), raw_ptr(p_N), N,
                                  F);
}
template <typename T>
void activation_forward_ref(Activation act, T* a_NF, const T* h_NF, const T* p_N, int64_t N,
                            int64_t F);
// dh = da * p * act'(h) assigned; dp[n] = sum_f da * act(h) assigned when both p_N and dp_N are
// non-null (one fixed association of the sum on every target, as swiglu's).
template <typename T>
void activation_backward(const Exec& ex, Activation act, DevPtr<T> dh_NF, DevPtr<T> dp_N,
                         DevPtr<const T> da_NF, DevPtr<const T> h_NF, DevPtr<const T> p_N,
                         int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_backward(act, raw_ptr(dh_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                    raw_ptr(h_NF), raw_ptr(p_N), N, F);
  return cuda::activation_backward(ex.stream, act, raw_ptr(dh_NF), raw_ptr(dp_N),
                                   raw_ptr(da_NF), raw_ptr(h_NF), raw_ptr(p_N), N, F);
}
template <typename T>
void activation_backward_ref(Activation act, T* dh_NF, T* dp_N, const T* da_NF, const T* h_NF,
                             const T* p_N, int64_t N, int64_t F);

// --bf16, as swiglu's: the same f32 arithmetic with the result written only as bf16 (round to
// nearest even), for outputs that only feed bf16 GEMMs (a into fc2; dh into fc1's backward). a16
// and dh16 are bitwise cast_f32_to_bf16 of the f32 versions' outputs; dp stays f32 and is
// bitwise the f32 version's.
inline void activation_forward_bf16(const Exec& ex, Activation act, DevPtr<bf16> a16_NF,
                                    DevPtr<const float> h_NF, DevPtr<const float> p_N, int64_t N,
                                    int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_forward_bf16(act, raw_ptr(a16_NF), raw_ptr(h_NF), raw_ptr(p_N), N, F);
  return cuda::activation_forward_bf16(ex.stream, act, raw_ptr(a16_NF), raw_ptr(h_NF), raw_ptr(p_N), N, F);
}
inline void activation_backward_bf16(const Exec& ex, Activation act, DevPtr<bf16> dh16_NF,
                                     DevPtr<float> dp_N, DevPtr<const float> da_NF,
                                     DevPtr<const float> h_NF, DevPtr<const float> p_N, int64_t N,
                                     int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_backward_bf16(act, raw_ptr(dh16_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                         raw_ptr(h_NF), raw_ptr(p_N), N, F);
  return cuda::activation_backward_bf16(ex.stream, act, raw_ptr(dh16_NF), raw_ptr(dp_N), raw_ptr(da_NF),
 raw_ptr(h_NF), raw_ptr(p_N), N, F);
}
// The same bf16 values written widened to f32 (the widened-bf16 GEMM path, ops/gemm_bf16.h):
// bitwise cast_bf16_to_f32 of what the _bf16 versions write.
inline void activation_forward_bf16w(const Exec& ex, Activation act, DevPtr<float> a_NF,
                                     DevPtr<const float> h_NF, DevPtr<const float> p_N, int64_t N,
                                     int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_forward_bf16w(act, raw_ptr(a_NF), raw_ptr(h_NF), raw_ptr(p_N), N, F);
  return cuda::activation_forward_bf16w(ex.stream, act, raw_ptr(a_NF), raw_ptr(h_NF), raw_ptr(p_N), N, F);
}
inline void activation_backward_bf16w(const Exec& ex, Activation act, DevPtr<float> dh_NF,
                                      DevPtr<float> dp_N, DevPtr<const float> da_NF,
                                      DevPtr<const float> h_NF, DevPtr<const float> p_N, int64_t N,
                                      int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_backward_bf16w(act, raw_ptr(dh_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                          raw_ptr(h_NF), raw_ptr(p_N), N, F);
  return cuda::activation_backward_bf16w(ex.stream, act, raw_ptr(dh_NF), raw_ptr(dp_N), raw_ptr(da_NF),
 raw_ptr(h_NF), raw_ptr(p_N), N, F);
}


// --bf16 keeps fc1's output h in bf16 alone, as swiglu's: the forms above that read it as bf16
// (the f32 output of the backward too, for the fc1 bias gradient), each bitwise that form on
// cast_bf16_to_f32(h16) (h widened exactly on load, the same f32 arithmetic and dp association).
inline void activation_forward_bf16(const Exec& ex, Activation act, DevPtr<bf16> a16_NF,
                                    DevPtr<const bf16> h16_NF, DevPtr<const float> p_N, int64_t N,
                                    int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_forward_bf16(act, raw_ptr(a16_NF), raw_ptr(h16_NF), raw_ptr(p_N), N, F);
  return cuda::activation_forward_bf16(ex.stream, act, raw_ptr(a16_NF), raw_ptr(h16_NF),
                                       raw_ptr(p_N), N, F);
}
inline void activation_forward_bf16w(const Exec& ex, Activation act, DevPtr<float> a_NF,
                                     DevPtr<const bf16> h16_NF, DevPtr<const float> p_N, int64_t N,
                                     int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_forward_bf16w(act, raw_ptr(a_NF), raw_ptr(h16_NF), raw_ptr(p_N), N, F);
  return cuda::activation_forward_bf16w(ex.stream, act, raw_ptr(a_NF), raw_ptr(h16_NF),
                                        raw_ptr(p_N), N, F);
}
inline void activation_backward(const Exec& ex, Activation act, DevPtr<float> dh_NF,
                                DevPtr<float> dp_N, DevPtr<const float> da_NF,
                                DevPtr<const bf16> h16_NF, DevPtr<const float> p_N, int64_t N,
                                int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_backward(act, raw_ptr(dh_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                    raw_ptr(h16_NF), raw_ptr(p_N), N, F);
  return cuda::activation_backward(ex.stream, act, raw_ptr(dh_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                   raw_ptr(h16_NF), raw_ptr(p_N), N, F);
}
inline void activation_backward_bf16(const Exec& ex, Activation act, DevPtr<bf16> dh16_NF,
                                     DevPtr<float> dp_N, DevPtr<const float> da_NF,
                                     DevPtr<const bf16> h16_NF, DevPtr<const float> p_N, int64_t N,
                                     int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_backward_bf16(act, raw_ptr(dh16_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                         raw_ptr(h16_NF), raw_ptr(p_N), N, F);
  return cuda::activation_backward_bf16(ex.stream, act, raw_ptr(dh16_NF), raw_ptr(dp_N),
                                        raw_ptr(da_NF), raw_ptr(h16_NF), raw_ptr(p_N), N, F);
}
inline void activation_backward_bf16w(const Exec& ex, Activation act, DevPtr<float> dh_NF,
                                      DevPtr<float> dp_N, DevPtr<const float> da_NF,
                                      DevPtr<const bf16> h16_NF, DevPtr<const float> p_N,
                                      int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::activation_backward_bf16w(act, raw_ptr(dh_NF), raw_ptr(dp_N), raw_ptr(da_NF),
                                          raw_ptr(h16_NF), raw_ptr(p_N), N, F);
  return cuda::activation_backward_bf16w(ex.stream, act, raw_ptr(dh_NF), raw_ptr(dp_N),
                                         raw_ptr(da_NF), raw_ptr(h16_NF), raw_ptr(p_N), N, F);
}
// Their oracle: the f32 plain loops on h widened (f32 outputs; the bf16 forms within bf16's
// rounding of them).
void activation_forward_ref(Activation act, float* a_NF, const bf16* h16_NF, const float* p_N,
                            int64_t N, int64_t F);
void activation_backward_ref(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                             const bf16* h16_NF, const float* p_N, int64_t N, int64_t F);

}  // namespace moecore::ops
