// Router softmax and top-k reference: plain loops, f64 accumulation, top-k by K rounds of full
// selection. The oracle for softmax_topk.cpp.
#include <cmath>
#include <vector>

#include "core/check.h"
#include "ops/softmax_topk.h"

namespace moecore::ops {

template <typename T>
void softmax_forward_ref(T* y_TE, const T* x_TE, int64_t n_tok, int64_t E) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TE + t * E;
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, double(x[e]));
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(double(x[e]) - m);
    // A row of all -inf gives NaN (0/0), as in PyTorch: there is no distribution to return.
    for (int64_t e = 0; e < E; ++e) y_TE[t * E + e] = T(std::exp(double(x[e]) - m) / s);
  }
}

template <typename T>
void softmax_backward_ref(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok, int64_t E) {
  for (int64_t t = 0; t < n_tok; ++t) {
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += double(dy_TE[t * E + e]) * double(y_TE[t * E + e]);
    for (int64_t e = 0; e < E; ++e) {
      dx_TE[t * E + e] = T(double(y_TE[t * E + e]) * (double(dy_TE[t * E + e]) - dot));
    }
  }
}

template <typename T>
void topk_ref(int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E, int64_t K) {
  MOE_CHECK(K >= 1 && K <= E, "[topk] K={} outside [1, E={}]: lower --moe-router-topk", K, E);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TE + t * E;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        // Strict '>' keeps the lower index on ties; -inf == -inf also ties to the lower index.
        if (!taken[e] && (best < 0 || x[e] > x[best])) best = e;
      }
      taken[best] = 1;
      idx_TK[t * K + k] = int32_t(best);
      val_TK[t * K + k] = x[best];
    }
  }
}

template void softmax_forward_ref<float>(float*, const float*, int64_t, int64_t);
template void softmax_forward_ref<double>(double*, const double*, int64_t, int64_t);
template void softmax_backward_ref<float>(float*, const float*, const float*, int64_t, int64_t);
template void softmax_backward_ref<double>(double*, const double*, const double*, int64_t,
                                           int64_t);
template void topk_ref<float>(int32_t*, float*, const float*, int64_t, int64_t, int64_t);
template void topk_ref<double>(int32_t*, double*, const double*, int64_t, int64_t, int64_t);

}  // namespace moecore::ops
