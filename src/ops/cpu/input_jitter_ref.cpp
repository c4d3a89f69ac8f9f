// Input jitter reference: plain loops. The oracle for input_jitter.cpp (and the CUDA kernels),
// with the op's explicit fmas.
#include <cmath>

#include "core/rng.h"
#include "ops/input_jitter.h"

namespace moecore::ops {

template <typename T>
void input_jitter_forward_ref(T* jitter, T* y, const T* x, double eps, uint64_t key,
                              uint64_t base, uint32_t lane, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double u = rng_uniform(key, base + static_cast<uint64_t>(i), lane);
    jitter[i] = static_cast<T>(std::fma(2.0 * eps, u, 1.0 - eps));
  }
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * jitter[i];
}

template <typename T>
void input_jitter_backward_ref(T* dx, const T* dy, const T* jitter, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = std::fma(dy[i], jitter[i], dx[i]);
  }
}

template void input_jitter_forward_ref<float>(float*, float*, const float*, double, uint64_t,
                                              uint64_t, uint32_t, int64_t);
template void input_jitter_forward_ref<double>(double*, double*, const double*, double, uint64_t,
                                               uint64_t, uint32_t, int64_t);
template void input_jitter_backward_ref<float>(float*, const float*, const float*, int64_t);
template void input_jitter_backward_ref<double>(double*, const double*, const double*, int64_t);

}  // namespace moecore::ops
