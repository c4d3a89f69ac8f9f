// Token embedding lookup and its deterministic backward (no atomics: columns are split among
// threads, tokens visited in order).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void embedding_forward(T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok, int64_t H,
                       int64_t V);
template <typename T>
void embedding_backward(T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok, int64_t H,
                        int64_t V);
void embedding_forward_bf16(float* y_TH, const int32_t* ids_T, const bf16* w_VH, int64_t n_tok,
                            int64_t H, int64_t V);
template <typename T>
void embedding_forward_shard(T* y_TH, const int32_t* ids_T, const T* w_RH, int64_t n_tok, int64_t H,
                             int64_t v0, int64_t rows, int64_t V);
template <typename T>
void embedding_backward_shard(T* dw_RH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                              int64_t H, int64_t v0, int64_t rows, int64_t V);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, the emulated CUDA build and the grid emulator's
// tests); `stream` is the context's. The lookups are exact and the backward adds in token order
// (no atomics): bitwise the CPU's. An id outside [0, V) cannot throw inside a step on a device:
// the data pipeline checks the ids on the host when it loads them, and here the kernels never
// touch memory outside the table, the forward writes NaN into that token's row (the step's
// non-finite guard reports it) and the backward skips the token.
namespace cuda {
template <typename T>
void embedding_forward(void* stream, T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok,
                       int64_t H, int64_t V);
void embedding_forward_bf16(void* stream, float* y_TH, const int32_t* ids_T, const bf16* w_VH,
                            int64_t n_tok, int64_t H, int64_t V);
template <typename T>
void embedding_backward(void* stream, T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                        int64_t H, int64_t V);
// A TP rank's slice of the table (the _shard ops below): ids of [0, V) outside the slice give
// zeros forward and nothing backward.
template <typename T>
void embedding_forward_shard(void* stream, T* y_TH, const int32_t* ids_T, const T* w_RH,
                             int64_t n_tok, int64_t H, int64_t v0, int64_t rows, int64_t V);
template <typename T>
void embedding_backward_shard(void* stream, T* dw_RH, const T* dy_TH, const int32_t* ids_T,
                              int64_t n_tok, int64_t H, int64_t v0, int64_t rows, int64_t V);
}  // namespace cuda

// y[t] = w[ids[t]]; every id must be in [0, V) (checked on the CPU; on a device see above).
template <typename T>
void embedding_forward(const Exec& ex, DevPtr<T> y_TH, DevPtr<const int32_t> ids_T,
                       DevPtr<const T> w_VH, int64_t n_tok, int64_t H, int64_t V) {
  if (ex.on_cpu())
    return cpu::embedding_forward(raw_ptr(y_TH), raw_ptr(ids_T), raw_ptr(w_VH), n_tok, H, V);
  return cuda::embedding_forward(ex.stream, raw_ptr(y_TH), raw_ptr(ids_T), raw_ptr(w_VH), n_tok,
                                 H, V);
}
template <typename T>
void embedding_forward_ref(T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok, int64_t H,
                           int64_t V);
// --bf16: y[t] = w[ids[t]] widened to f32, from the table's bf16 values (exact; the backward is
// embedding_backward into the f32 gradients).
inline void embedding_forward_bf16(const Exec& ex, DevPtr<float> y_TH, DevPtr<const int32_t> ids_T,
                                   DevPtr<const bf16> w_VH, int64_t n_tok, int64_t H, int64_t V) {
  if (ex.on_cpu())
    return cpu::embedding_forward_bf16(raw_ptr(y_TH), raw_ptr(ids_T), raw_ptr(w_VH), n_tok, H, V);
  return cuda::embedding_forward_bf16(ex.stream, raw_ptr(y_TH), raw_ptr(ids_T), raw_ptr(w_VH),
                                      n_tok, H, V);
}
void embedding_forward_bf16_ref(float* y_TH, const int32_t* ids_T, const bf16* w_VH, int64_t n_tok,
                                int64_t H, int64_t V);
// dw[ids[t]] += dy[t].
template <typename T>
void embedding_backward(const Exec& ex, DevPtr<T> dw_VH, DevPtr<const T> dy_TH,
                        DevPtr<const int32_t> ids_T, int64_t n_tok, int64_t H, int64_t V) {
  if (ex.on_cpu())
    return cpu::embedding_backward(raw_ptr(dw_VH), raw_ptr(dy_TH), raw_ptr(ids_T), n_tok, H, V);
  return cuda::embedding_backward(ex.stream, raw_ptr(dw_VH), raw_ptr(dy_TH), raw_ptr(ids_T),
                                  n_tok, H, V);
}
template <typename T>
void embedding_backward_ref(T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                            int64_t H, int64_t V);

// Vocab-parallel (a TP rank's slice of the table): w_RH holds the rows [v0, v0 + rows) of a
// vocabulary of V. y[t] = w[ids[t] - v0] for the ids in the slice, zeros for the others (the
// TP group's sum of y is the whole lookup); every id must be in [0, V). The slice is the model's
// rows of the rank's share of the padded table: it may be empty (rows = 0, v0 anywhere: a share
// of padding only), which gives zeros forward and nothing backward.
template <typename T>
void embedding_forward_shard(const Exec& ex, DevPtr<T> y_TH, DevPtr<const int32_t> ids_T,
                             DevPtr<const T> w_RH, int64_t n_tok, int64_t H, int64_t v0,
                             int64_t rows, int64_t V) {
  if (ex.on_cpu())
    return cpu::embedding_forward_shard(raw_ptr(y_TH), raw_ptr(ids_T), raw_ptr(w_RH), n_tok, H, v0,
                                        rows, V);
  return cuda::embedding_forward_shard(ex.stream, raw_ptr(y_TH), raw_ptr(ids_T), raw_ptr(w_RH),
                                       n_tok, H, v0, rows, V);
}
template <typename T>
void embedding_forward_shard_ref(T* y_TH, const int32_t* ids_T, const T* w_RH, int64_t n_tok,
                                 int64_t H, int64_t v0, int64_t rows, int64_t V);
// Its backward: dw[ids[t] - v0] += dy[t] for the ids in the slice (in token order).
template <typename T>
void embedding_backward_shard(const Exec& ex, DevPtr<T> dw_RH, DevPtr<const T> dy_TH,
                              DevPtr<const int32_t> ids_T, int64_t n_tok, int64_t H, int64_t v0,
                              int64_t rows, int64_t V) {
  if (ex.on_cpu())
    return cpu::embedding_backward_shard(raw_ptr(dw_RH), raw_ptr(dy_TH), raw_ptr(ids_T), n_tok, H,
                                         v0, rows, V);
  return cuda::embedding_backward_shard(ex.stream, raw_ptr(dw_RH), raw_ptr(dy_TH), raw_ptr(ids_T),
                                        n_tok, H, v0, rows, V);
}
template <typename T>
void embedding_backward_shard_ref(T* dw_RH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                                  int64_t H, int64_t v0, int64_t rows, int64_t V);

}  // namespace moecore::ops
