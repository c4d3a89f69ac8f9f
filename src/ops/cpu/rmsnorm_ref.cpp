// RMSNorm reference: plain loops with f64 accumulation. The oracle for the fast path in
// rmsnorm.cpp and the fallback when a fast path is in doubt.
#include <cmath>

#include "ops/rmsnorm.h"

namespace moecore::ops {

template <typename T>
void rmsnorm_forward_ref(T* y_TH, T* rstd_T, const T* x_TH, const T* w_H, int64_t n_tok,
                         int64_t H, double eps) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    double ss = 0;
    for (int64_t h = 0; h < H; ++h) ss += double(x[h]) * double(x[h]);
    double rstd = 1.0 / std::sqrt(ss / double(H) + eps);
    rstd_T[t] = T(rstd);
    for (int64_t h = 0; h < H; ++h) y_TH[t * H + h] = T(double(x[h]) * rstd * double(w_H[h]));
  }
}

template <typename T>
void rmsnorm_backward_ref(T* dx_TH, T* dw_H, const T* dy_TH, const T* x_TH, const T* w_H,
                          const T* rstd_T, int64_t n_tok, int64_t H) {
  // dx = rstd * (w*dy) - x * rstd^3 * mean(w*dy*x)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    const T* dy = dy_TH + t * H;
    double rstd = double(rstd_T[t]);
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += double(w_H[h]) * double(dy[h]) * double(x[h]);
    double c = rstd * rstd * rstd * dot / double(H);
    for (int64_t h = 0; h < H; ++h) {
      dx_TH[t * H + h] = T(rstd * double(w_H[h]) * double(dy[h]) - double(x[h]) * c);
    }
  }
  // dw += sum_t dy * x * rstd
  for (int64_t h = 0; h < H; ++h) {
    double acc = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
      acc += double(dy_TH[t * H + h]) * double(x_TH[t * H + h]) * double(rstd_T[t]);
    }
    dw_H[h] = T(double(dw_H[h]) + acc);
  }
}

template void rmsnorm_forward_ref<float>(float*, float*, const float*, const float*, int64_t,
                                         int64_t, double);
template void rmsnorm_forward_ref<double>(double*, double*, const double*, const double*, int64_t,
                                          int64_t, double);
template void rmsnorm_backward_ref<float>(float*, float*, const float*, const float*,
                                          const float*, const float*, int64_t, int64_t);
template void rmsnorm_backward_ref<double>(double*, double*, const double*, const double*,
                                           const double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops
