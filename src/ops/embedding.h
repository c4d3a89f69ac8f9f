// Token embedding lookup and its deterministic backward (no atomics: columns are split among
// threads, tokens visited in order).
#pragma once

#include <cstdint>

namespace moecore::ops {

// y[t] = w[ids[t]]; every id must be in [0, V) (checked).
template <typename T>
void embedding_forward(T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok, int64_t H,
                       int64_t V);
template <typename T>
void embedding_forward_ref(T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok,
                           int64_t H, int64_t V);
// dw[ids[t]] += dy[t].
template <typename T>
void embedding_backward(T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok, int64_t H,
                        int64_t V);
template <typename T>
void embedding_backward_ref(T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                            int64_t H, int64_t V);

}  // namespace moecore::ops
