// y = a + b, a plain loop: the oracle of add.cpp.
#include "ops/add.h"

namespace moecore::ops {

template <typename T>
void add_ref(T* y, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

template void add_ref<float>(float*, const float*, const float*, int64_t);
template void add_ref<double>(double*, const double*, const double*, int64_t);
template void add_ref<int64_t>(int64_t*, const int64_t*, const int64_t*, int64_t);

}  // namespace moecore::ops
