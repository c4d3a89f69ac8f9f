// The numeric guard's ops from their definitions: the oracle.
#include <cmath>

#include "ops/numeric_guard.h"

namespace moecore::ops {

template <typename T>
void flag_nonfinite_ref(int32_t* flag, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i]) || std::isinf(x[i])) *flag = 1;
  }
}

void flag_at_least_ref(int32_t* flag, const double* value, const double* threshold) {
  const double v = std::fabs(*value);
  if (std::isfinite(v) && v >= *threshold) *flag = 1;
}

void skip_if_flagged_ref(AdamWStep* step, const int32_t* flags, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (flags[i] != 0) step->skip = 1;
  }
}

template void flag_nonfinite_ref<float>(int32_t*, const float*, int64_t);
template void flag_nonfinite_ref<double>(int32_t*, const double*, int64_t);

}  // namespace moecore::ops
