// Sigmoid gate, plain loops in f64: the oracle of sigmoid_gate.cpp.
#include <cmath>

#include "ops/sigmoid_gate.h"

namespace moecore::ops {

namespace {
double sigmoid_d(double l) {
  return 1.0 / (1.0 + std::exp(-l));
}
}  // namespace

template <typename T>
void sigmoid_gate_forward_ref(T* y_NH, const T* s_NH, const T* l_N, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n) {
    const double g = sigmoid_d(double(l_N[n]));
    for (int64_t h = 0; h < H; ++h) {
      y_NH[n * H + h] = T(double(y_NH[n * H + h]) + g * double(s_NH[n * H + h]));
    }
  }
}

template <typename T>
void sigmoid_gate_backward_ref(T* ds_NH, T* dl_N, const T* dy_NH, const T* s_NH, const T* l_N,
                               int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n) {
    const double g = sigmoid_d(double(l_N[n]));
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += double(dy_NH[n * H + h]) * double(s_NH[n * H + h]);
    dl_N[n] = T(g * (1.0 - g) * dot);
    for (int64_t h = 0; h < H; ++h) ds_NH[n * H + h] = T(g * double(dy_NH[n * H + h]));
  }
}

template void sigmoid_gate_forward_ref<float>(float*, const float*, const float*, int64_t, int64_t);
template void sigmoid_gate_forward_ref<double>(double*, const double*, const double*, int64_t,
                                               int64_t);
template void sigmoid_gate_backward_ref<float>(float*, float*, const float*, const float*,
                                               const float*, int64_t, int64_t);
template void sigmoid_gate_backward_ref<double>(double*, double*, const double*, const double*,
                                                const double*, int64_t, int64_t);

}  // namespace moecore::ops
