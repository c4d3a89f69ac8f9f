// Element-wise MLP activations, plain loops in f64 (the oracle of activation.cpp): a = act(h) * p,
// GeLU exact (F.gelu), its tanh form (Megatron's openai_gelu, HF's gelu_new), squared ReLU.
#include <cmath>
#include <vector>

#include "core/check.h"
#include "ops/activation.h"

namespace moecore::ops {

void check_elementwise_activation(Activation act, const char* op) {
  MOE_CHECK(!activation_gated(act),
            "[{}] {} is gated (rows of [gate | up]): ops/swiglu.h computes it", op,
            activation_name(act));
}

namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // Megatron's openai_gelu constant
constexpr double kGeluTanhCubic = 0.044715;

double act_d(Activation act, double x) {
  switch (act) {
    case Activation::GeLU:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::GeLUTanh:
      return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x)));
    case Activation::SquaredReLU:
      return x > 0 ? x * x : 0.0;
    case Activation::SwiGLU:
      break;
  }
  return NAN;
}

// d act / dx.
double dact_d(Activation act, double x) {
  switch (act) {
    case Activation::GeLU: {
      const double pi = 3.14159265358979323846;
      return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) +
             x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * pi);
    }
    case Activation::GeLUTanh: {
      const double u = kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x);
      const double t = std::tanh(u);
      const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluTanhCubic * x * x);
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
    }
    case Activation::SquaredReLU:
      return x > 0 ? 2.0 * x : 0.0;
    case Activation::SwiGLU:
      break;
  }
  return NAN;
}

}  // namespace

template <typename T>
void activation_forward_ref(Activation act, T* a_NF, const T* h_NF, const T* p_N, int64_t N,
                            int64_t F) {
  check_elementwise_activation(act, "activation_forward_ref");
  for (int64_t n = 0; n < N; ++n) {
    const double p = p_N ? double(p_N[n]) : 1.0;
    for (int64_t f = 0; f < F; ++f) a_NF[n * F + f] = T(act_d(act, double(h_NF[n * F + f])) * p);
  }
}

template <typename T>
void activation_backward_ref(Activation act, T* dh_NF, T* dp_N, const T* da_NF, const T* h_NF,
                             const T* p_N, int64_t N, int64_t F) {
  check_elementwise_activation(act, "activation_backward_ref");
  for (int64_t n = 0; n < N; ++n) {
    const double p = p_N ? double(p_N[n]) : 1.0;
    double dp = 0;
    for (int64_t f = 0; f < F; ++f) {
      const double h = double(h_NF[n * F + f]), da = double(da_NF[n * F + f]);
      dh_NF[n * F + f] = T(da * p * dact_d(act, h));
      dp += act_d(act, h) * da;
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

void activation_forward_ref(Activation act, float* a_NF, const bf16* h16_NF, const float* p_N,
                            int64_t N, int64_t F) {
  const std::vector<float> h = widened(h16_NF, N * F);
  activation_forward_ref(act, a_NF, h.data(), p_N, N, F);
}

void activation_backward_ref(Activation act, float* dh_NF, float* dp_N, const float* da_NF,
                             const bf16* h16_NF, const float* p_N, int64_t N, int64_t F) {
  const std::vector<float> h = widened(h16_NF, N * F);
  activation_backward_ref(act, dh_NF, dp_N, da_NF, h.data(), p_N, N, F);
}

template void activation_forward_ref<float>(Activation, float*, const float*, const float*, int64_t,
                                            int64_t);
template void activation_forward_ref<double>(Activation, double*, const double*, const double*,
                                             int64_t, int64_t);
template void activation_backward_ref<float>(Activation, float*, float*, const float*, const float*,
                                             const float*, int64_t, int64_t);
template void activation_backward_ref<double>(Activation, double*, double*, const double*,
                                              const double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops
