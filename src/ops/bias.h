// A bias over the columns of a row-major [M, N] matrix: forward y[m, n] += b[n], backward
// db[n] += sum over m of dy[m, n], the rows summed in order (bitwise the same for any thread
// count: threads own columns).
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
}  // namespace cpu

template <typename T>
void bias_forward(const Exec& ex, DevPtr<T> y_MN, DevPtr<const T> b_N, int64_t M, int64_t N) {
  if (ex.on_cpu()) return cpu::bias_forward(raw_ptr(y_MN), raw_ptr(b_N), M, N);
  no_kernel(ex, "bias_forward");
}
template <typename T>
void bias_forward_ref(T* y_MN, const T* b_N, int64_t M, int64_t N);
template <typename T>
void bias_backward(const Exec& ex, DevPtr<T> db_N, DevPtr<const T> dy_MN, int64_t M, int64_t N) {
  if (ex.on_cpu()) return cpu::bias_backward(raw_ptr(db_N), raw_ptr(dy_MN), M, N);
  no_kernel(ex, "bias_backward");
}
template <typename T>
void bias_backward_ref(T* db_N, const T* dy_MN, int64_t M, int64_t N);

}  // namespace moecore::ops
