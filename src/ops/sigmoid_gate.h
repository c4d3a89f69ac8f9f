// A per-row sigmoid gate added into an output (the shared expert's gate,
// --moe-shared-expert-gate): forward y[n, h] += sigmoid(l[n]) s[n, h]; backward
// ds[n, h] = sigmoid(l[n]) dy[n, h] and dl[n] = sigmoid'(l[n]) sum_h dy[n, h] s[n, h].
// Both take the logits, so a recomputed forward needs no saved gate. Rows are independent and
// each row's sum runs in index order: bitwise the same for any thread count.
// Legend: N rows (tokens), H hidden.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void sigmoid_gate_forward(T* y_NH, const T* s_NH, const T* l_N, int64_t N, int64_t H);
template <typename T>
void sigmoid_gate_backward(T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH, const T* l_N,
                           int64_t N, int64_t H);
}  // namespace cpu
// The CUDA kernels (ops/cuda/sigmoid_gate.cu: the CUDA build, and the grid emulator's tests on the
// CPU); `stream` is the context's. A block per row; the backward's dot in a fixed block tree:
// within the dtype's tolerance of the reference, bitwise run to run.
namespace cuda {
template <typename T>
void sigmoid_gate_forward(void* stream, T* y_NH, const T* s_NH, const T* l_N, int64_t N,
                          int64_t H);
template <typename T>
void sigmoid_gate_backward(void* stream, T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH,
                           const T* l_N, int64_t N, int64_t H);
}  // namespace cuda

// y accumulated (+=): the gated rows are added to what y holds (the routed experts' output).
template <typename T>
void sigmoid_gate_forward(const Exec& ex, DevPtr<T> y_NH, DevPtr<const T> s_NH, DevPtr<const T> l_N,
                          int64_t N, int64_t H) {
  if (ex.on_cpu())
    return cpu::sigmoid_gate_forward(raw_ptr(y_NH), raw_ptr(s_NH), raw_ptr(l_N), N, H);
  return cuda::sigmoid_gate_forward(ex.stream, raw_ptr(y_NH), raw_ptr(s_NH), raw_ptr(l_N), N, H);
}
template <typename T>
void sigmoid_gate_forward_ref(T* y_NH, const T* s_NH, const T* l_N, int64_t N, int64_t H);
// ds and dl assigned. ds may alias dy (each element is read before it is written).
template <typename T>
void sigmoid_gate_backward(const Exec& ex, DevPtr<T> ds_NH, DevPtr<T> dl_N, DevPtr<const T> dy_NH,
                           DevPtr<const T> s_NH, DevPtr<const T> l_N, int64_t N, int64_t H) {
  if (ex.on_cpu())
    return cpu::sigmoid_gate_backward(raw_ptr(ds_NH), raw_ptr(dl_N), raw_ptr(dy_NH), raw_ptr(s_NH),
                                      raw_ptr(l_N), N, H);
  return cuda::sigmoid_gate_backward(ex.stream, raw_ptr(ds_NH), raw_ptr(dl_N), raw_ptr(dy_NH),
                                     raw_ptr(s_NH), raw_ptr(l_N), N, H);
}
template <typename T>
void sigmoid_gate_backward_ref(T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH, const T* l_N,
                               int64_t N, int64_t H);

}  // namespace moecore::ops
