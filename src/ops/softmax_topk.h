// Row softmax, sigmoid and top-k for the router (router math is f32 or f64, never bf16: bf16
// top-k flips near-ties and destabilises the load balance).
#pragma once

#include <cstdint>

namespace moecore::ops {

// y[T,E] = softmax(x) per row; y may alias x.
template <typename T>
void softmax_forward(T* y_TE, const T* x_TE, int64_t n_tok, int64_t E);
template <typename T>
void softmax_forward_ref(T* y_TE, const T* x_TE, int64_t n_tok, int64_t E);
// dx = y * (dy - sum(dy * y)); dx may alias dy.
template <typename T>
void softmax_backward(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok, int64_t E);
template <typename T>
void softmax_backward_ref(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok, int64_t E);

// Top-k per row: idx/val [T, K] in descending value order; ties go to the lower index.
// Entries equal to -inf are never preferred over finite ones.
template <typename T>
void topk(int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E, int64_t K);
template <typename T>
void topk_ref(int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E, int64_t K);

}  // namespace moecore::ops
