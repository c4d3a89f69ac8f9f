// Sum of squares, a plain loop accumulating in long double: the oracle of sum_squares.cpp.
#include "ops/sum_squares.h"

namespace moecore::ops {

template <typename T>
void sum_squares_ref(double* out, const T* x, int64_t n) {
  long double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<long double>(x[i]) * x[i];
  *out = static_cast<double>(s);
}

template void sum_squares_ref<float>(double*, const float*, int64_t);
template void sum_squares_ref<double>(double*, const double*, int64_t);

}  // namespace moecore::ops
