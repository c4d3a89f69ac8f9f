// A bias over the columns of a row-major [M, N] matrix: forward y[m, n] += b[n], backward
// db[n] += sum over m of dy[m, n], the rows summed in order (bitwise the same for any thread
// count: threads own columns). And its grouped form, one bias per group of rows (per expert),
// the rows grouped as ops::grouped_gemm groups them, optionally scaled by the routing prob.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void bias_forward(T* y_MN, const T* b_N, int64_t M, int64_t N);
template <typename T>
void bias_backward(T* db_N, const T* dy_MN, int64_t M, int64_t N);
template <typename T>
void grouped_bias_forward(T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G, int64_t G,
                          int64_t C);
template <typename T>
void grouped_bias_backward(T* db_GC, T* dp_N, const T* dy_NC, const T* b_GC, const T* p_N,
                           const int64_t* m_G, int64_t G, int64_t C);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, and the grid emulator's tests on the CPU); `stream`
// is the context's. The grouped forms read the group sizes from device memory (no host sync):
// each group is a y (db: z) index of the grid, each element has one writer and one order (db:
// the group's rows in ops/cuda/reduce_cols.cuh's block tree; dp: the row's columns in order), no
// atomics.
namespace cuda {
template <typename T>
void bias_forward(void* stream, T* y_MN, const T* b_N, int64_t M, int64_t N);
// db += the column sums of dy, each over the rows in the fixed two-stage tree of
// ops/cuda/reduce_cols.cuh (set by the shape: the same bits run to run, not the CPU's order).
template <typename T>
void bias_backward(void* stream, T* db_N, const T* dy_MN, int64_t M, int64_t N);
// G at most 65535 (the grid's y dimension).
template <typename T>
void grouped_bias_forward(void* stream, T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G,
                          int64_t G, int64_t C);
template <typename T>
void grouped_bias_backward(void* stream, T* db_GC, T* dp_N, const T* dy_NC, const T* b_GC,
                           const T* p_N, const int64_t* m_G, int64_t G, int64_t C);
}  // namespace cuda

template <typename T>
void bias_forward(const Exec& ex, DevPtr<T> y_MN, DevPtr<const T> b_N, int64_t M, int64_t N) {
  if (ex.on_cpu()) return cpu::bias_forward(raw_ptr(y_MN), raw_ptr(b_N), M, N);
  return cuda::bias_forward(ex.stream, raw_ptr(y_MN), raw_ptr(b_N), M, N);
}
template <typename T>
void bias_forward_ref(T* y_MN, const T* b_N, int64_t M, int64_t N);
template <typename T>
void bias_backward(const Exec& ex, DevPtr<T> db_N, DevPtr<const T> dy_MN, int64_t M, int64_t N) {
  if (ex.on_cpu()) return cpu::bias_backward(raw_ptr(db_N), raw_ptr(dy_MN), M, N);
  return cuda::bias_backward(ex.stream, raw_ptr(db_N), raw_ptr(dy_MN), M, N);
}
template <typename T>
void bias_backward_ref(T* db_N, const T* dy_MN, int64_t M, int64_t N);

// Grouped: rows stacked by group as in ops::grouped_gemm (group g owns rows
// [sum_{h<g} m_G[h], + m_G[g]), sizes read from memory; rows past the last group untouched).
// With s_n = p[n] (1 when p_N is null), g(n) the group of row n:
// forward  y[n, c] += s_n b[g(n), c];
// backward db[g, c] += sum over the group's rows, in order, of s_n dy[n, c] (deterministic: each
//          element's sum has one order whatever the thread count), and, when p_N and dp_N are
//          both non-null, dp[n] += sum_c dy[n, c] b[g(n), c] (accumulated: the activation's
//          backward assigned dp first).
// Megatron's grouped experts add fc2's bias times the prob (experts.py, TEGroupedMLP._apply_bias).
template <typename T>
void grouped_bias_forward(const Exec& ex, DevPtr<T> y_NC, DevPtr<const T> b_GC, DevPtr<const T> p_N,
                          DevPtr<const int64_t> m_G, int64_t G, int64_t C) {
  if (ex.on_cpu())
    return cpu::grouped_bias_forward(raw_ptr(y_NC), raw_ptr(b_GC), raw_ptr(p_N), raw_ptr(m_G), G,
                                     C);
  return cuda::grouped_bias_forward(ex.stream, raw_ptr(y_NC), raw_ptr(b_GC), raw_ptr(p_N),
                                    raw_ptr(m_G), G, C);
}
template <typename T>
void grouped_bias_forward_ref(T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G, int64_t G,
                              int64_t C);
template <typename T>
void grouped_bias_backward(const Exec& ex, DevPtr<T> db_GC, DevPtr<T> dp_N, DevPtr<const T> dy_NC,
                           DevPtr<const T> b_GC, DevPtr<const T> p_N, DevPtr<const int64_t> m_G,
                           int64_t G, int64_t C) {
  if (ex.on_cpu())
    return cpu::grouped_bias_backward(raw_ptr(db_GC), raw_ptr(dp_N), raw_ptr(dy_NC), raw_ptr(b_GC),
                                      raw_ptr(p_N), raw_ptr(m_G), G, C);
  return cuda::grouped_bias_backward(ex.stream, raw_ptr(db_GC), raw_ptr(dp_N), raw_ptr(dy_NC),
                                     raw_ptr(b_GC), raw_ptr(p_N), raw_ptr(m_G), G, C);
}
template <typename T>
void grouped_bias_backward_ref(T* db_GC, T* dp_N, const T* dy_NC, const T* b_GC, const T* p_N,
                               const int64_t* m_G, int64_t G, int64_t C);

}  // namespace moecore::ops
