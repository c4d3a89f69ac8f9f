// Sum of squares of a tensor in f64 (the gradient norm): *out = sum_i x_i^2, written to `out` (a
// planned scalar, so a device backend can keep it on the device). Bitwise the same for any
// thread count: fixed blocks whose bounds depend on n only, fixed lanes within a block, summed
// in order.
#pragma once

#include <cstdint>

namespace moecore::ops {

template <typename T>
void sum_squares(double* out, const T* x, int64_t n);
// Plain loop with a long double accumulator: the oracle.
template <typename T>
void sum_squares_ref(double* out, const T* x, int64_t n);

}  // namespace moecore::ops
