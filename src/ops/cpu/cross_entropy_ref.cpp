// Output head + cross entropy reference: per token, logits in f64 by plain loops, then
// log-sum-exp and the loss; no chunking and no workspace. The oracle for cross_entropy.cpp.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "ops/cross_entropy.h"

namespace moecore::ops {

namespace {
void check_shape_and_targets(const HeadLossShape& s, const int32_t* target_T) {
  MOE_CHECK(s.n_tok >= 0 && s.H >= 1 && s.V >= 1 && s.chunk >= 1,
            "[head_loss] bad shape n_tok={} H={} V={} chunk={}: all but n_tok must be >= 1",
            s.n_tok, s.H, s.V, s.chunk);
  for (int64_t t = 0; t < s.n_tok; ++t) {
    MOE_CHECK(target_T[t] < s.V,
              "[head_loss] target {} at position {} >= V={}: the data and --vocab-size disagree",
              target_T[t], t, s.V);
  }
}

}  // namespace

template <typename T>
double head_loss_forward_ref(T* loss_T, T* lse_T, const T* h_TH, const T* w_VH,
                             const int32_t* target_T, const HeadLossShape& s) {
  check_shape_and_targets(s, target_T);
  const int64_t H = s.H, V = s.V;
  std::vector<double> z(V);
  double total = 0;
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += double(h_TH[t * H + k]) * double(w_VH[v * H + k]);
      z[v] = acc;
    }
    double m = *std::max_element(z.begin(), z.end());
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(z[v] - m);
    double lse = m + std::log(se);
    lse_T[t] = T(lse);
    double loss = target_T[t] >= 0 ? lse - z[target_T[t]] : 0.0;
    loss_T[t] = T(loss);
    total += loss;
  }
  return total;
}

template <typename T>
void head_loss_backward_ref(T* dh_TH, T* dw_VH, const T* h_TH, const T* w_VH,
                            const int32_t* target_T, const T* lse_T, T dloss,
                            const HeadLossShape& s) {
  check_shape_and_targets(s, target_T);
  const int64_t H = s.H, V = s.V;
  std::vector<double> dz(V), dw_acc(V * H, 0.0);
  for (int64_t t = 0; t < s.n_tok; ++t) {
    const int32_t tgt = target_T[t];
    // d loss_t / d logit_v = softmax_v - [v == target]; ignored tokens have no gradient.
    for (int64_t v = 0; v < V; ++v) {
      if (tgt < 0) {
        dz[v] = 0;
        continue;
      }
      double z = 0;
      for (int64_t k = 0; k < H; ++k) z += double(h_TH[t * H + k]) * double(w_VH[v * H + k]);
      dz[v] = (std::exp(z - double(lse_T[t])) - (v == tgt ? 1.0 : 0.0)) * double(dloss);
    }
    for (int64_t k = 0; k < H; ++k) {
      double acc = 0;
      for (int64_t v = 0; v < V; ++v) acc += dz[v] * double(w_VH[v * H + k]);
      dh_TH[t * H + k] = T(acc);
    }
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t k = 0; k < H; ++k) dw_acc[v * H + k] += dz[v] * double(h_TH[t * H + k]);
    }
  }
  for (int64_t i = 0; i < V * H; ++i) dw_VH[i] = T(double(dw_VH[i]) + dw_acc[i]);
}

template double head_loss_forward_ref<float>(float*, float*, const float*, const float*,
                                             const int32_t*, const HeadLossShape&);
template double head_loss_forward_ref<double>(double*, double*, const double*, const double*,
                                              const int32_t*, const HeadLossShape&);
template void head_loss_backward_ref<float>(float*, float*, const float*, const float*,
                                            const int32_t*, const float*, float,
                                            const HeadLossShape&);
template void head_loss_backward_ref<double>(double*, double*, const double*, const double*,
                                             const int32_t*, const double*, double,
                                             const HeadLossShape&);

}  // namespace moecore::ops
