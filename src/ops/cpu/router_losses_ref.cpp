// Router losses reference: plain loops, the sums in token-major order (another order than the
// fast path's: the comparison is within f64 rounding), the gradients entry by entry. The oracle
// for router_losses.cpp.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/router_losses.h"

namespace moecore::ops {

template <typename C>
void aux_loss_value_ref(double* value, const double* aux_scores_TE, const C* counts_E,
                        int64_t n_tok, int64_t E, int64_t K) {
  std::vector<double> P(E, 0.0);
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t e = 0; e < E; ++e) P[e] += aux_scores_TE[t * E + e];
  }
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += P[e] * static_cast<double>(counts_E[e]);
  const double T = static_cast<double>(n_tok);
  *value = static_cast<double>(E) / (static_cast<double>(K) * T * T) * acc;
}

void seq_aux_loss_value_ref(double* value, const double* aux_scores_TE,
                            const int64_t* seq_counts_BE, int64_t n_tok, int64_t E, int64_t K,
                            int64_t B) {
  const double S = static_cast<double>(n_tok / B);
  double total = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> P(E, 0.0);
    for (int64_t t = b; t < n_tok; t += B) {
      for (int64_t e = 0; e < E; ++e) P[e] += aux_scores_TE[t * E + e];
    }
    double acc = 0;
    for (int64_t e = 0; e < E; ++e) acc += P[e] * static_cast<double>(seq_counts_BE[b * E + e]);
    total += static_cast<double>(E) / (static_cast<double>(K) * S * S) * acc;
  }
  *value = total / static_cast<double>(B);
}

void z_loss_value_ref(double* value, double* lse_T, const double* logits_TE, int64_t n_tok,
                      int64_t E) {
  double acc = 0;
  for (int64_t t = 0; t < n_tok; ++t) {
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, logits_TE[t * E + e]);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(logits_TE[t * E + e] - m);
    lse_T[t] = m + std::log(z);
    acc += lse_T[t] * lse_T[t];
  }
  *value = n_tok > 0 ? acc / static_cast<double>(n_tok) : 0.0;
}

template <typename C>
void aux_loss_grad_ref(double* daux_TE, const C* counts_E, double coeff, int64_t n_tok,
                       int64_t E) {
  const double T = static_cast<double>(n_tok);
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      daux_TE[t * E + e] += coeff * static_cast<double>(counts_E[e]) / (T * T);
    }
  }
}

void seq_aux_loss_grad_ref(double* daux_TE, const int64_t* seq_counts_BE, double coeff,
                           int64_t n_tok, int64_t E, int64_t B) {
  const double S = static_cast<double>(n_tok / B);
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t b = t % B;
    for (int64_t e = 0; e < E; ++e) {
      daux_TE[t * E + e] +=
          coeff * static_cast<double>(seq_counts_BE[b * E + e]) / (S * S * static_cast<double>(B));
    }
  }
}

void z_loss_grad_ref(double* dlogits_TE, const double* lse_T, const double* softmax_TE,
                     double coeff, int64_t n_tok, int64_t E) {
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      dlogits_TE[t * E + e] += coeff * lse_T[t] * softmax_TE[t * E + e];
    }
  }
}

template void aux_loss_value_ref<int64_t>(double*, const double*, const int64_t*, int64_t,
                                          int64_t, int64_t);
template void aux_loss_value_ref<double>(double*, const double*, const double*, int64_t, int64_t,
                                         int64_t);
template void aux_loss_grad_ref<int64_t>(double*, const int64_t*, double, int64_t, int64_t);
template void aux_loss_grad_ref<double>(double*, const double*, double, int64_t, int64_t);

}  // namespace moecore::ops
