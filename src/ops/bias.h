// A bias over the columns of a row-major [M, N] matrix: forward y[m, n] += b[n], backward
// db[n] += sum over m of dy[m, n], the rows summed in order (bitwise the same for any thread
// count: threads own columns).
#pragma once

#include <cstdint>

namespace moecore::ops {

template <typename T>
void bias_forward(T* y_MN, const T* b_N, int64_t M, int64_t N);
template <typename T>
void bias_forward_ref(T* y_MN, const T* b_N, int64_t M, int64_t N);
template <typename T>
void bias_backward(T* db_N, const T* dy_MN, int64_t M, int64_t N);
template <typename T>
void bias_backward_ref(T* db_N, const T* dy_MN, int64_t M, int64_t N);

}  // namespace moecore::ops
