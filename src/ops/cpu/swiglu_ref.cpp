// SwiGLU reference: plain loops in f64. a = silu(gate) * up * p with h rows [gate | up];
// the oracle for swiglu.cpp.
#include <cmath>

#include "ops/swiglu.h"

namespace moecore::ops {

namespace {
double sigmoid_d(double g) { return 1.0 / (1.0 + std::exp(-g)); }
}  // namespace

template <typename T>
void swiglu_forward_ref(T* a_NF, const T* h_N2F, const T* p_N, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    double p = p_N ? double(p_N[n]) : 1.0;
    for (int64_t f = 0; f < F; ++f) {
      double g = double(h_N2F[n * 2 * F + f]), u = double(h_N2F[n * 2 * F + F + f]);
      a_NF[n * F + f] = T(g * sigmoid_d(g) * u * p);
    }
  }
}

template <typename T>
void swiglu_backward_ref(T* dh_N2F, T* dp_N, const T* da_NF, const T* h_N2F, const T* p_N,
                         int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    double p = p_N ? double(p_N[n]) : 1.0;
    double dp = 0;
    for (int64_t f = 0; f < F; ++f) {
      double g = double(h_N2F[n * 2 * F + f]), u = double(h_N2F[n * 2 * F + F + f]);
      double da = double(da_NF[n * F + f]);
      double s = sigmoid_d(g);
      double silu = g * s;
      double dsilu = s * (1.0 + g * (1.0 - s));  // d/dg [g * sigmoid(g)]
      dh_N2F[n * 2 * F + f] = T(da * p * u * dsilu);
      dh_N2F[n * 2 * F + F + f] = T(da * p * silu);
      dp += silu * u * da;
    }
    if (p_N && dp_N) dp_N[n] = T(dp);
  }
}

template void swiglu_forward_ref<float>(float*, const float*, const float*, int64_t, int64_t);
template void swiglu_forward_ref<double>(double*, const double*, const double*, int64_t, int64_t);
template void swiglu_backward_ref<float>(float*, float*, const float*, const float*, const float*,
                                         int64_t, int64_t);
template void swiglu_backward_ref<double>(double*, double*, const double*, const double*,
                                          const double*, int64_t, int64_t);

}  // namespace moecore::ops
