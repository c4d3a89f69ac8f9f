// SwiGLU with the per-row routing probability of MOE_SEMANTICS: h rows are [gate | up] (F each),
// a = silu(gate) * up * p. p may be null (dense MLP, shared expert): then p = 1.
#pragma once

#include <cstdint>

namespace moecore::ops {

template <typename T>
void swiglu_forward(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F);
template <typename T>
void swiglu_forward_ref(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F);
// dh assigned; dp_N assigned when both p_N and dp_N are non-null.
template <typename T>
void swiglu_backward(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N, int64_t N,
                     int64_t F);
template <typename T>
void swiglu_backward_ref(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N,
                         int64_t N, int64_t F);

}  // namespace moecore::ops
