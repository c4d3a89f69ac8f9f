// Plain-loop AdamW (Megatron's decoupled weight decay, see adamw.h): the oracle for adamw.cpp.
// Every intermediate in double, straight from the formula; only m and v round to f32, because
// that is how they are stored.
#include <cmath>

#include "core/check.h"
#include "ops/adamw.h"

namespace moecore::ops {

void check_adamw_params(const char* who, int64_t n, const AdamWParams& a, const AdamWStep& s);

template <typename T>
void adamw_step_ref(T* p, const T* g, float* m, float* v, int64_t n, const AdamWParams& a,
                    const AdamWStep& s) {
  check_adamw_params("adamw_ref", n, a, s);
  if (s.skip) return;
  double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(s.step));
  double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(s.step));
  for (int64_t i = 0; i < n; ++i) {
    double gi = s.grad_scale * static_cast<double>(g[i]);
    m[i] = static_cast<float>(a.beta1 * m[i] + (1.0 - a.beta1) * gi);
    v[i] = static_cast<float>(a.beta2 * v[i] + (1.0 - a.beta2) * gi * gi);
    double mhat = m[i] / bc1, vhat = v[i] / bc2;
    double pi = static_cast<double>(p[i]);
    p[i] = static_cast<T>(pi - s.lr * (mhat / (std::sqrt(vhat) + a.eps) + a.weight_decay * pi));
  }
}

template void adamw_step_ref<float>(float*, const float*, float*, float*, int64_t,
                                    const AdamWParams&, const AdamWStep&);
template void adamw_step_ref<double>(double*, const double*, float*, float*, int64_t,
                                     const AdamWParams&, const AdamWStep&);

}  // namespace moecore::ops
