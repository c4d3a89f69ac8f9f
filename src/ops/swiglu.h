// SwiGLU with the per-row routing probability of MOE_SEMANTICS: h rows are [gate | up] (F each),
// a = silu(gate) * up * p. p may be null (dense MLP, shared expert): then p = 1.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void swiglu_forward(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F);
template <typename T>
void swiglu_backward(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N, int64_t N,
                     int64_t F);
void swiglu_forward_bf16(bf16* a16_NF, const float* h_N2F, const float* p_N, int64_t N, int64_t F);
void swiglu_backward_bf16(bf16* dh16_N2F, float* dp_N, const float* da_NF, const float* h_N2F,
                          const float* p_N, int64_t N, int64_t F);
void swiglu_forward_bf16w(float* a_NF, const float* h_N2F, const float* p_N, int64_t N, int64_t F);
void swiglu_backward_bf16w(float* dh_N2F, float* dp_N, const float* da_NF, const float* h_N2F,
                           const float* p_N, int64_t N, int64_t F);
// h kept in bf16 (the forms below that take a bf16 h).
void swiglu_forward_bf16(bf16* a16_NF, const bf16* h16_N2F, const float* p_N, int64_t N,
                         int64_t F);
void swiglu_forward_bf16w(float* a_NF, const bf16* h16_N2F, const float* p_N, int64_t N,
                          int64_t F);
void swiglu_backward(float* dh_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                     const float* p_N, int64_t N, int64_t F);
void swiglu_backward_bf16(bf16* dh16_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                          const float* p_N, int64_t N, int64_t F);
void swiglu_backward_bf16w(float* dh_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                           const float* p_N, int64_t N, int64_t F);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. The sigmoid
// through the device's exp (the CPU's fast_exp is not shared), dp's sum over a row in a fixed
// block tree: within the dtype's tolerance of the reference, bitwise run to run.
namespace cuda {
template <typename T>
void swiglu_forward(void* stream, T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F);
template <typename T>
void swiglu_backward(void* stream, T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N,
                     int64_t N, int64_t F);
// The bf16 forms: the same kernels writing bf16 bits or their widened values (bitwise the casts).
void swiglu_forward_bf16(void* stream, bf16* a16_NF, const float* h_N2F, const float* p_N,
                         int64_t N, int64_t F);
void swiglu_backward_bf16(void* stream, bf16* dh16_N2F, float* dp_N, const float* da_NF,
                          const float* h_N2F, const float* p_N, int64_t N, int64_t F);
void swiglu_forward_bf16w(void* stream, float* a_NF, const float* h_N2F, const float* p_N,
                          int64_t N, int64_t F);
void swiglu_backward_bf16w(void* stream, float* dh_N2F, float* dp_N, const float* da_NF,
                           const float* h_N2F, const float* p_N, int64_t N, int64_t F);
// h kept in bf16: the same kernels, h widened on load (the forwards load 16 bytes of h a step
// when F % 8 == 0 and h is 16-byte aligned; the backwards one element a step, the order dp's
// block tree sums in).
void swiglu_forward_bf16(void* stream, bf16* a16_NF, const bf16* h16_N2F, const float* p_N,
                         int64_t N, int64_t F);
void swiglu_forward_bf16w(void* stream, float* a_NF, const bf16* h16_N2F, const float* p_N,
                          int64_t N, int64_t F);
void swiglu_backward(void* stream, float* dh_N2F, float* dp_N, const float* da_NF,
                     const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F);
void swiglu_backward_bf16(void* stream, bf16* dh16_N2F, float* dp_N, const float* da_NF,
                          const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F);
void swiglu_backward_bf16w(void* stream, float* dh_N2F, float* dp_N, const float* da_NF,
                           const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F);
}  // namespace cuda

template <typename T>
void swiglu_forward(const Exec& ex, DevPtr<T> a_NF, DevPtr<const T> h_N2F, DevPtr<const T> p_N,
                    int64_t N, int64_t F) {
  if (ex.on_cpu()) return cpu::swiglu_forward(raw_ptr(a_NF), raw_ptr(h_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_forward(ex.stream, raw_ptr(a_NF), raw_ptr(h_N2F), raw_ptr(p_N), N, F);
}
template <typename T>
void swiglu_forward_ref(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F);
// dh assigned; dp_N assigned when both p_N and dp_N are non-null.
template <typename T>
void swiglu_backward(const Exec& ex, DevPtr<T> dh_N2F, DevPtr<T> dp_N, DevPtr<const T> da_NF,
                     DevPtr<const T> h_N2F, DevPtr<const T> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_backward(raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF), raw_ptr(h_N2F),
                                raw_ptr(p_N), N, F);
  return cuda::swiglu_backward(ex.stream, raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                               raw_ptr(h_N2F), raw_ptr(p_N), N, F);
}
template <typename T>
void swiglu_backward_ref(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N,
                         int64_t N, int64_t F);

// --bf16: the same f32 arithmetic with the result written only as bf16 (round to nearest
// even), for outputs that only feed bf16 GEMMs (a into fc2; dh into fc1's backward). a16 and
// dh16 are bitwise cast_f32_to_bf16 of the f32 versions' outputs; dp stays f32 and is bitwise
// the f32 version's (its sum has one fixed association on every target).
inline void swiglu_forward_bf16(const Exec& ex, DevPtr<bf16> a16_NF, DevPtr<const float> h_N2F,
                                DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_forward_bf16(raw_ptr(a16_NF), raw_ptr(h_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_forward_bf16(ex.stream, raw_ptr(a16_NF), raw_ptr(h_N2F), raw_ptr(p_N), N, F);
}
inline void swiglu_backward_bf16(const Exec& ex, DevPtr<bf16> dh16_N2F, DevPtr<float> dp_N,
                                 DevPtr<const float> da_NF, DevPtr<const float> h_N2F,
                                 DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_backward_bf16(raw_ptr(dh16_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                                     raw_ptr(h_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_backward_bf16(ex.stream, raw_ptr(dh16_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
 raw_ptr(h_N2F), raw_ptr(p_N), N, F);
}
// The same bf16 values written widened to f32 (the widened-bf16 GEMM path, ops/gemm_bf16.h):
// bitwise cast_bf16_to_f32 of what the _bf16 versions write.
inline void swiglu_forward_bf16w(const Exec& ex, DevPtr<float> a_NF, DevPtr<const float> h_N2F,
                                 DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_forward_bf16w(raw_ptr(a_NF), raw_ptr(h_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_forward_bf16w(ex.stream, raw_ptr(a_NF), raw_ptr(h_N2F), raw_ptr(p_N), N, F);
}
inline void swiglu_backward_bf16w(const Exec& ex, DevPtr<float> dh_N2F, DevPtr<float> dp_N,
                                  DevPtr<const float> da_NF, DevPtr<const float> h_N2F,
                                  DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_backward_bf16w(raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                                      raw_ptr(h_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_backward_bf16w(ex.stream, raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
 raw_ptr(h_N2F), raw_ptr(p_N), N, F);
}


// --bf16 keeps fc1's output h in bf16 alone: the forms above that read it as bf16 (the f32 output
// of the backward too, for the fc1 bias gradient). h is widened exactly on load and the f32
// arithmetic is the f32-h form's, so each is bitwise that form on cast_bf16_to_f32(h16) (dp
// included: the same association on every target).
inline void swiglu_forward_bf16(const Exec& ex, DevPtr<bf16> a16_NF, DevPtr<const bf16> h16_N2F,
                                DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_forward_bf16(raw_ptr(a16_NF), raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_forward_bf16(ex.stream, raw_ptr(a16_NF), raw_ptr(h16_N2F), raw_ptr(p_N), N,
                                   F);
}
inline void swiglu_forward_bf16w(const Exec& ex, DevPtr<float> a_NF, DevPtr<const bf16> h16_N2F,
                                 DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_forward_bf16w(raw_ptr(a_NF), raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_forward_bf16w(ex.stream, raw_ptr(a_NF), raw_ptr(h16_N2F), raw_ptr(p_N), N,
                                    F);
}
inline void swiglu_backward(const Exec& ex, DevPtr<float> dh_N2F, DevPtr<float> dp_N,
                            DevPtr<const float> da_NF, DevPtr<const bf16> h16_N2F,
                            DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_backward(raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF), raw_ptr(h16_N2F),
                                raw_ptr(p_N), N, F);
  return cuda::swiglu_backward(ex.stream, raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                               raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
}
inline void swiglu_backward_bf16(const Exec& ex, DevPtr<bf16> dh16_N2F, DevPtr<float> dp_N,
                                 DevPtr<const float> da_NF, DevPtr<const bf16> h16_N2F,
                                 DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_backward_bf16(raw_ptr(dh16_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                                     raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_backward_bf16(ex.stream, raw_ptr(dh16_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                                    raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
}
inline void swiglu_backward_bf16w(const Exec& ex, DevPtr<float> dh_N2F, DevPtr<float> dp_N,
                                  DevPtr<const float> da_NF, DevPtr<const bf16> h16_N2F,
                                  DevPtr<const float> p_N, int64_t N, int64_t F) {
  if (ex.on_cpu())
    return cpu::swiglu_backward_bf16w(raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                                      raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
  return cuda::swiglu_backward_bf16w(ex.stream, raw_ptr(dh_N2F), raw_ptr(dp_N), raw_ptr(da_NF),
                                     raw_ptr(h16_N2F), raw_ptr(p_N), N, F);
}
// Their oracle: the f32 plain loops on h widened (f32 outputs; the bf16 forms within bf16's
// rounding of them).
void swiglu_forward_ref(float* a_NF, const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F);
void swiglu_backward_ref(float* dh_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                         const float* p_N, int64_t N, int64_t F);

}  // namespace moecore::ops
