// Row softmax, sigmoid and top-k for the router (router math is f32 or f64, never bf16: bf16
// top-k flips near-ties and destabilises the load balance).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "core/host_device.h"

namespace moecore::ops {

// The row body of topk's CPU fast path and CUDA kernel (never of topk_ref): the K largest of
// x[0, E) into idx / val, largest first, by insertion while scanning e upwards. An entry moves only
// past strictly smaller values, so ties keep index order and -inf never displaces anything (it is
// not > -inf or a finite value).
template <typename T>
MOE_HOST_DEVICE inline void topk_row(int32_t* idx, T* val, const T* x, int64_t E, int64_t K) {
  int64_t cnt = 0;
  for (int64_t e = 0; e < E; ++e) {
    const T v = x[e];
    int64_t j;
    if (cnt < K) {
      j = cnt++;
    } else if (v > val[K - 1]) {
      j = K - 1;
    } else {
      continue;
    }
    while (j > 0 && v > val[j - 1]) {
      val[j] = val[j - 1];
      idx[j] = idx[j - 1];
      --j;
    }
    val[j] = v;
    idx[j] = static_cast<int32_t>(e);
  }
}

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void softmax_forward(T* y_TE, const T* x_TE, int64_t n_tok, int64_t E);
template <typename T>
void softmax_backward(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok, int64_t E);
template <typename T>
void topk(int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E, int64_t K);
}  // namespace cpu
// The CUDA kernels (ops/cuda/softmax_topk.cu); `stream` is the context's. The switches below call
// them where the build has kernels. topk: bitwise cpu::topk's indices and values.
namespace cuda {
template <typename T>
void softmax_forward(void* stream, T* y_TE, const T* x_TE, int64_t n_tok, int64_t E);
template <typename T>
void softmax_backward(void* stream, T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok,
                      int64_t E);
template <typename T>
void topk(void* stream, int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E,
          int64_t K);
}  // namespace cuda

// y[T,E] = softmax(x) per row; y may alias x.
template <typename T>
void softmax_forward(const Exec& ex, DevPtr<T> y_TE, DevPtr<const T> x_TE, int64_t n_tok,
                     int64_t E) {
  if (ex.on_cpu()) return cpu::softmax_forward(raw_ptr(y_TE), raw_ptr(x_TE), n_tok, E);
  return cuda::softmax_forward(ex.stream, raw_ptr(y_TE), raw_ptr(x_TE), n_tok, E);
}
template <typename T>
void softmax_forward_ref(T* y_TE, const T* x_TE, int64_t n_tok, int64_t E);
// dx = y * (dy - sum(dy * y)); dx may alias dy.
template <typename T>
void softmax_backward(const Exec& ex, DevPtr<T> dx_TE, DevPtr<const T> dy_TE, DevPtr<const T> y_TE,
                      int64_t n_tok, int64_t E) {
  if (ex.on_cpu())
    return cpu::softmax_backward(raw_ptr(dx_TE), raw_ptr(dy_TE), raw_ptr(y_TE), n_tok, E);
  return cuda::softmax_backward(ex.stream, raw_ptr(dx_TE), raw_ptr(dy_TE), raw_ptr(y_TE), n_tok,
                                E);
}
template <typename T>
void softmax_backward_ref(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok, int64_t E);

// Top-k per row: idx/val [T, K] in descending value order; ties go to the lower index.
// Entries equal to -inf are never preferred over finite ones.
template <typename T>
void topk(const Exec& ex, DevPtr<int32_t> idx_TK, DevPtr<T> val_TK, DevPtr<const T> x_TE,
          int64_t n_tok, int64_t E, int64_t K) {
  if (ex.on_cpu()) return cpu::topk(raw_ptr(idx_TK), raw_ptr(val_TK), raw_ptr(x_TE), n_tok, E, K);
  return cuda::topk(ex.stream, raw_ptr(idx_TK), raw_ptr(val_TK), raw_ptr(x_TE), n_tok, E, K);
}
template <typename T>
void topk_ref(int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E, int64_t K);

}  // namespace moecore::ops
