// LayerNorm reference: plain loops with f64 accumulation. The oracle for the fast path in
// layernorm.cpp.
#include <cmath>

#include "ops/layernorm.h"

namespace moecore::ops {

template <typename T>
void layernorm_forward_ref(T* y_TH, T* mean_T, T* rstd_T, const T* x_TH, const T* w_H, const T* b_H,
                           int64_t n_tok, int64_t H, double eps, bool zero_centered) {
  const double g0 = zero_centered ? 1.0 : 0.0;
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    double sum = 0;
    for (int64_t h = 0; h < H; ++h) sum += double(x[h]);
    const double mean = sum / double(H);
    double ss = 0;
    for (int64_t h = 0; h < H; ++h) ss += (double(x[h]) - mean) * (double(x[h]) - mean);
    const double rstd = 1.0 / std::sqrt(ss / double(H) + eps);
    mean_T[t] = T(mean);
    rstd_T[t] = T(rstd);
    for (int64_t h = 0; h < H; ++h) {
      y_TH[t * H + h] = T((double(x[h]) - mean) * rstd * (g0 + double(w_H[h])) + double(b_H[h]));
    }
  }
}

template <typename T>
void layernorm_backward_ref(T* dx_TH, T* dw_H, T* db_H, const T* dy_TH, const T* x_TH, const T* w_H,
                            const T* mean_T, const T* rstd_T, int64_t n_tok, int64_t H,
                            bool zero_centered) {
  // xhat = (x - mean) rstd, g = dy * gain:
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
  const double g0 = zero_centered ? 1.0 : 0.0;
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TH + t * H;
    const T* dy = dy_TH + t * H;
    const double mean = double(mean_T[t]), rstd = double(rstd_T[t]);
    double sg = 0, sgx = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double g = double(dy[h]) * (g0 + double(w_H[h]));
      sg += g;
      sgx += g * (double(x[h]) - mean) * rstd;
    }
    for (int64_t h = 0; h < H; ++h) {
      const double g = double(dy[h]) * (g0 + double(w_H[h]));
      const double xhat = (double(x[h]) - mean) * rstd;
      dx_TH[t * H + h] = T(rstd * (g - sg / double(H) - xhat * sgx / double(H)));
    }
  }
  // dw += sum_t dy * xhat; db += sum_t dy
  for (int64_t h = 0; h < H; ++h) {
    double aw = 0, ab = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
      const double dy = double(dy_TH[t * H + h]);
      aw += dy * (double(x_TH[t * H + h]) - double(mean_T[t])) * double(rstd_T[t]);
      ab += dy;
    }
    dw_H[h] = T(double(dw_H[h]) + aw);
    db_H[h] = T(double(db_H[h]) + ab);
  }
}

template void layernorm_forward_ref<float>(float*, float*, float*, const float*, const float*,
                                           const float*, int64_t, int64_t, double, bool);
template void layernorm_forward_ref<double>(double*, double*, double*, const double*, const double*,
                                            const double*, int64_t, int64_t, double, bool);
template void layernorm_backward_ref<float>(float*, float*, float*, const float*, const float*,
                                            const float*, const float*, const float*, int64_t,
                                            int64_t, bool);
template void layernorm_backward_ref<double>(double*, double*, double*, const double*,
                                             const double*, const double*, const double*,
                                             const double*, int64_t, int64_t, bool);

}  // namespace moecore::ops
