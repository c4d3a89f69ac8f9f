// Column bias, plain loops: the oracle of bias.cpp (the column sums accumulate in f64).
#include "ops/bias.h"

namespace moecore::ops {

template <typename T>
void bias_forward_ref(T* y_MN, const T* b_N, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) y_MN[m * N + n] += b_N[n];
  }
}

template <typename T>
void bias_backward_ref(T* db_N, const T* dy_MN, int64_t M, int64_t N) {
  for (int64_t n = 0; n < N; ++n) {
    double acc = 0;
    for (int64_t m = 0; m < M; ++m) acc += static_cast<double>(dy_MN[m * N + n]);
    db_N[n] = static_cast<T>(static_cast<double>(db_N[n]) + acc);
  }
}

template void bias_forward_ref<float>(float*, const float*, int64_t, int64_t);
template void bias_forward_ref<double>(double*, const double*, int64_t, int64_t);
template void bias_backward_ref<float>(float*, const float*, int64_t, int64_t);
template void bias_backward_ref<double>(double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops
