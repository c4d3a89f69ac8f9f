// Input jitter fast path: OpenMP over elements (each draw depends only on its index); the fmas
// are the op's (input_jitter.h), so the bits do not depend on the compiler's contraction.
#include <cmath>

#include "core/rng.h"
#include "ops/input_jitter.h"

namespace moecore::ops::cpu {

namespace {
constexpr int64_t kParallelMin = int64_t{1} << 14;
}  // namespace

template <typename T>
void input_jitter_forward(T* jitter, T* y, const T* x, double eps, uint64_t key, uint64_t base,
                          uint32_t lane, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    double u = rng_uniform(key, base + static_cast<uint64_t>(i), lane);
    jitter[i] = static_cast<T>(std::fma(2.0 * eps, u, 1.0 - eps));
    y[i] = x[i] * jitter[i];
  }
}

template <typename T>
void input_jitter_backward(T* dx, const T* dy, const T* jitter, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dx[i] = std::fma(dy[i], jitter[i], dx[i]);
}

template void input_jitter_forward<float>(float*, float*, const float*, double, uint64_t,
                                          uint64_t, uint32_t, int64_t);
template void input_jitter_forward<double>(double*, double*, const double*, double, uint64_t,
                                           uint64_t, uint32_t, int64_t);
template void input_jitter_backward<float>(float*, const float*, const float*, int64_t);
template void input_jitter_backward<double>(double*, const double*, const double*, int64_t);

}  // namespace moecore::ops::cpu
