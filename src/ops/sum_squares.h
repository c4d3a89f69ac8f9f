// Sum of squares of a tensor in f64 (the gradient norm): *out = sum_i x_i^2, written to `out` (a
// planned scalar, so a device backend can keep it on the device). Bitwise the same for any
// thread count: fixed blocks whose bounds depend on n only, fixed lanes within a block, summed
// in order.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void sum_squares(double* out, const T* x, int64_t n);
}  // namespace cpu

template <typename T>
void sum_squares(const Exec& ex, DevPtr<double> out, DevPtr<const T> x, int64_t n) {
  if (ex.on_cpu()) return cpu::sum_squares(raw_ptr(out), raw_ptr(x), n);
  no_kernel(ex, "sum_squares");
}
// Plain loop with a long double accumulator: the oracle.
template <typename T>
void sum_squares_ref(double* out, const T* x, int64_t n);

}  // namespace moecore::ops
