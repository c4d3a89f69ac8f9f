// Load balancing reference: plain loops; the quantile by a full sort of each column. The oracle
// for router_balance.cpp.
#include <algorithm>
#include <functional>
#include <vector>

#include "core/check.h"
#include "ops/router_balance.h"

namespace moecore::ops {

void count_tokens_per_expert_ref(int64_t* counts_E, int64_t* seq_counts_BE,
                                 const int32_t* idx_TK, int64_t n_tok, int64_t K, int64_t E,
                                 int64_t B) {
  for (int64_t e = 0; e < E; ++e) {
    counts_E[e] = 0;
    for (int64_t i = 0; i < n_tok * K; ++i) counts_E[e] += idx_TK[i] == e;
    if (!seq_counts_BE) continue;
    for (int64_t b = 0; b < B; ++b) {
      int64_t c = 0;
      for (int64_t t = b; t < n_tok; t += B) {
        for (int64_t k = 0; k < K; ++k) c += idx_TK[t * K + k] == e;
      }
      seq_counts_BE[b * E + e] = c;
    }
  }
}

void accumulate_counts_ref(double* sum_E, const int64_t* counts_E, int64_t E) {
  for (int64_t e = 0; e < E; ++e) sum_E[e] = sum_E[e] + static_cast<double>(counts_E[e]);
}

void running_mean_counts_ref(double* mean_E, const double* sum_E, const int64_t* counts_E,
                             double n_micro, int64_t E) {
  for (int64_t e = 0; e < E; ++e) {
    const double c = counts_E ? static_cast<double>(counts_E[e]) : 0.0;
    mean_E[e] = (counts_E ? sum_E[e] + c : sum_E[e]) / n_micro;
  }
}

void quantile_beta_estimate_ref(double* beta_sum_E, const double* logits_TE,
                                const double* keyv_TK1, int64_t n_tok, int64_t E, int64_t K) {
  MOE_CHECK(K >= 1 && K < E && n_tok * K % E == 0,
            "[{}] K={} E={} T={}: needs 1 <= K < E (keyv is a top-(K+1) of E) and T K divisible "
            "by E",
            "quantile_beta_estimate_ref", K, E, n_tok);
  const int64_t C = n_tok * K / E;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<double> col(n_tok);
    for (int64_t t = 0; t < n_tok; ++t) col[t] = logits_TE[t * E + e] - keyv_TK1[t * (K + 1) + K];
    std::sort(col.begin(), col.end(), std::greater<double>());
    beta_sum_E[e] += col[C];
  }
}

void divide_in_place_ref(double* x, double d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / d;
}

void quantile_beta_update_ref(float* beta_E, const double* avg_E, double ema, int64_t E) {
  std::vector<double> b(E);
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) {
    b[e] = ema * static_cast<double>(beta_E[e]) + (1.0 - ema) * avg_E[e];
    mean += b[e];
  }
  mean /= static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) beta_E[e] = static_cast<float>(b[e] - mean);
}

void expert_bias_update_ref(float* bias_E, const double* counts_E, float rate, int64_t E) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += counts_E[e];
  const double mean = sum / static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    if (counts_E[e] < mean) bias_E[e] += rate;
    if (counts_E[e] > mean) bias_E[e] -= rate;
  }
}

}  // namespace moecore::ops
