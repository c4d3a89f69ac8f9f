// Sums of squares, plain loops accumulating in long double: the oracles of sum_squares.cpp.
#include "ops/sum_squares.h"

namespace moecore::ops {

template <typename T>
void sum_squares_ref(double* out, const T* x, int64_t n) {
  long double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<long double>(x[i]) * x[i];
  *out = static_cast<double>(s);
}

template <typename T>
void sum_squares_ranges_ref(double* out, const T* x, const ElemRange* ranges, int64_t n_ranges) {
  long double s = 0;
  for (int64_t r = 0; r < n_ranges; ++r) {
    for (int64_t i = ranges[r].begin; i < ranges[r].begin + ranges[r].count; ++i) {
      s += static_cast<long double>(x[i]) * x[i];
    }
  }
  *out = static_cast<double>(s);
}

template void sum_squares_ranges_ref<float>(double*, const float*, const ElemRange*, int64_t);
template void sum_squares_ranges_ref<double>(double*, const double*, const ElemRange*, int64_t);
template void sum_squares_ref<float>(double*, const float*, int64_t);
template void sum_squares_ref<double>(double*, const double*, int64_t);

}  // namespace moecore::ops
