// SwiGLU reference: plain loops in f64. a = silu(gate) * up * p with h rows [gate | up];
// the oracle for swiglu.cpp.
#include <cmath>
#include <vector>

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

// h kept in bf16: widened (exactly), then the plain loops above.
namespace {
std::vector<float> widened(const bf16* h16, int64_t n) {
  std::vector<float> h(size_t(n > 0 ? n : 0));
  for (int64_t i = 0; i < n; ++i) h[size_t(i)] = bf16_to_float(h16[i]);
  return h;
}
}  // namespace

void swiglu_forward_ref(float* a_NF, const bf16* h16_N2F, const float* p_N, int64_t N, int64_t F) {
  const std::vector<float> h = widened(h16_N2F, N * 2 * F);
  swiglu_forward_ref(a_NF, h.data(), p_N, N, F);
}

void swiglu_backward_ref(float* dh_N2F, float* dp_N, const float* da_NF, const bf16* h16_N2F,
                         const float* p_N, int64_t N, int64_t F) {
  const std::vector<float> h = widened(h16_N2F, N * 2 * F);
  swiglu_backward_ref(dh_N2F, dp_N, da_NF, h.data(), p_N, N, F);
}

template void swiglu_forward_ref<float>(float*, const float*, const float*, int64_t, int64_t);
template void swiglu_forward_ref<double>(double*, const double*, const double*, int64_t, int64_t);
template void swiglu_backward_ref<float>(float*, float*, const float*, const float*, const float*,
                                         int64_t, int64_t);
template void swiglu_backward_ref<double>(double*, double*, const double*, const double*,
                                          const double*, int64_t, int64_t);

}  // namespace moecore::ops
