// y = a + b: one vectorised pass, OpenMP over large tensors.
#include "ops/add.h"
#include "core/check.h"

namespace moecore::ops::cpu {
namespace {
constexpr int64_t kParallelMin = int64_t{1} << 16;
}  // namespace

template <typename T>
void add(T* y, const T* a, const T* b, int64_t n) {
  MOE_CHECK(n >= 0, "[add] n={} < 0", n);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = add_element(a[i], b[i]);
}

template void add<float>(float*, const float*, const float*, int64_t);
template void add<double>(double*, const double*, const double*, int64_t);
template void add<int64_t>(int64_t*, const int64_t*, const int64_t*, int64_t);

}  // namespace moecore::ops::cpu
