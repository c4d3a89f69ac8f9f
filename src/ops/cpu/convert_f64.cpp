// f64 conversions fast path: one vectorisable pass, OpenMP over large tensors (elementwise, so
// the bits do not depend on the thread count).
#include <cmath>
#include <type_traits>

#include "ops/convert_f64.h"

namespace moecore::ops::cpu {

namespace {
constexpr int64_t kParallelMin = int64_t{1} << 16;
}  // namespace

template <typename T>
void widen_to_f64(double* y, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<double>(x[i]);
}

template <typename T>
void narrow_from_f64(T* y, const double* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(x[i]);
}

template <typename T>
void add_from_f64(T* y, const double* x, const T* factor, int64_t n) {
  if (!factor) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) y[i] += static_cast<T>(x[i]);
    return;
  }
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, double>)
      y[i] = std::fma(x[i], factor[i], y[i]);  // the op's one rounding (ops/convert_f64.h)
    else
      y[i] += static_cast<T>(x[i] * static_cast<double>(factor[i]));
  }
}

template void widen_to_f64<float>(double*, const float*, int64_t);
template void widen_to_f64<double>(double*, const double*, int64_t);
template void narrow_from_f64<float>(float*, const double*, int64_t);
template void narrow_from_f64<double>(double*, const double*, int64_t);
template void add_from_f64<float>(float*, const double*, const float*, int64_t);
template void add_from_f64<double>(double*, const double*, const double*, int64_t);

}  // namespace moecore::ops::cpu
