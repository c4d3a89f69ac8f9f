// f64 conversions reference: plain loops. The oracle for convert_f64.cpp.
#include <cmath>
#include <type_traits>

#include "ops/convert_f64.h"

namespace moecore::ops {

template <typename T>
void widen_to_f64_ref(double* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<double>(x[i]);
}

template <typename T>
void narrow_from_f64_ref(T* y, const double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(x[i]);
}

template <typename T>
void add_from_f64_ref(T* y, const double* x, const T* factor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double f = factor ? static_cast<double>(factor[i]) : 1.0;
    if constexpr (std::is_same_v<T, double>)
      y[i] = std::fma(x[i], f, y[i]);  // the op's one rounding (ops/convert_f64.h)
    else
      y[i] = y[i] + static_cast<T>(x[i] * f);
  }
}

template void widen_to_f64_ref<float>(double*, const float*, int64_t);
template void widen_to_f64_ref<double>(double*, const double*, int64_t);
template void narrow_from_f64_ref<float>(float*, const double*, int64_t);
template void narrow_from_f64_ref<double>(double*, const double*, int64_t);
template void add_from_f64_ref<float>(float*, const double*, const float*, int64_t);
template void add_from_f64_ref<double>(double*, const double*, const double*, int64_t);

}  // namespace moecore::ops
