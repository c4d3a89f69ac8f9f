// Router losses fast path. The values are sums in a fixed order (experts, then tokens), serial:
// they are T x E work once per forward, and a parallel reduction would change their bits with
// the thread count. The gradients are elementwise: OpenMP over tokens.
#include <algorithm>
#include <cmath>

#include "ops/router_losses.h"

namespace moecore::ops::cpu {

namespace {
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

template <typename C>
void aux_loss_value(double* value, const double* aux_scores_TE, const C* counts_E, int64_t n_tok,
                    int64_t E, int64_t K) {
  const int64_t n = n_tok;
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) {
    double psum = 0;
    for (int64_t t = 0; t < n; ++t) psum += aux_scores_TE[t * E + e];
    acc += psum * static_cast<double>(counts_E[e]);
  }
  *value = acc * static_cast<double>(E) / (static_cast<double>(K) * n * n);
}

void seq_aux_loss_value(double* value, const double* aux_scores_TE, const int64_t* seq_counts_BE,
                        int64_t n_tok, int64_t E, int64_t K, int64_t B) {
  const int64_t S = n_tok / B;
  double acc = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < E; ++e) {
      double psum = 0;
      for (int64_t q = 0; q < S; ++q) psum += aux_scores_TE[(q * B + b) * E + e];
      acc += psum * static_cast<double>(seq_counts_BE[b * E + e]);
    }
  }
  *value = acc * static_cast<double>(E) / (static_cast<double>(K) * S * S) / B;
}

void z_loss_value(double* value, double* lse_T, const double* logits_TE, int64_t n_tok,
                  int64_t E) {
  const int64_t n = n_tok;
  double acc = 0;
  for (int64_t t = 0; t < n; ++t) {
    const double* l = logits_TE + t * E;
    double m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
    lse_T[t] = m + std::log(z);
    acc += lse_T[t] * lse_T[t];
  }
  *value = n > 0 ? acc / n : 0.0;
}

template <typename C>
void aux_loss_grad(double* daux_TE, const C* counts_E, double coeff, int64_t n_tok, int64_t E) {
  const int64_t n = n_tok;
#pragma omp parallel for schedule(static) if (n * E >= kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double gte = coeff / (static_cast<double>(n) * n) * static_cast<double>(counts_E[e]);
      daux_TE[t * E + e] += gte;
    }
  }
}

void seq_aux_loss_grad(double* daux_TE, const int64_t* seq_counts_BE, double coeff,
                       int64_t n_tok, int64_t E, int64_t B) {
  const int64_t n = n_tok, S = n / B;
#pragma omp parallel for schedule(static) if (n * E >= kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double gte = coeff / (static_cast<double>(S) * S * B) *
                         static_cast<double>(seq_counts_BE[(t % B) * E + e]);
      daux_TE[t * E + e] += gte;
    }
  }
}

void z_loss_grad(double* dlogits_TE, const double* lse_T, const double* softmax_TE, double coeff,
                 int64_t n_tok, int64_t E) {
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      dlogits_TE[t * E + e] += coeff * lse_T[t] * softmax_TE[t * E + e];
    }
  }
}

template void aux_loss_value<int64_t>(double*, const double*, const int64_t*, int64_t, int64_t,
                                      int64_t);
template void aux_loss_value<double>(double*, const double*, const double*, int64_t, int64_t,
                                     int64_t);
template void aux_loss_grad<int64_t>(double*, const int64_t*, double, int64_t, int64_t);
template void aux_loss_grad<double>(double*, const double*, double, int64_t, int64_t);

}  // namespace moecore::ops::cpu
