// Load balancing fast path: [E]-sized or counting work, serial (a count per expert has one
// writer only in this order, and the sums over E are in e order, as the reference's).
#include <algorithm>
#include <cstring>
#include <functional>

#include "core/check.h"
#include "ops/router_balance.h"

namespace moecore::ops::cpu {

void count_tokens_per_expert(int64_t* counts_E, int64_t* seq_counts_BE, const int32_t* idx_TK,
                             int64_t n_tok, int64_t K, int64_t E, int64_t B) {
  std::memset(counts_E, 0, sizeof(int64_t) * E);
  if (seq_counts_BE) std::memset(seq_counts_BE, 0, sizeof(int64_t) * B * E);
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx_TK[t * K + k];
      if (e < 0) continue;
      ++counts_E[e];
      if (seq_counts_BE) ++seq_counts_BE[(t % B) * E + e];
    }
  }
}

void accumulate_counts(double* sum_E, const int64_t* counts_E, int64_t E) {
  for (int64_t e = 0; e < E; ++e) sum_E[e] += static_cast<double>(counts_E[e]);
}

void running_mean_counts(double* mean_E, const double* sum_E, const int64_t* counts_E,
                         double n_micro, int64_t E) {
  if (!counts_E) {
    for (int64_t e = 0; e < E; ++e) mean_E[e] = sum_E[e] / n_micro;
    return;
  }
  for (int64_t e = 0; e < E; ++e) {
    mean_E[e] = (sum_E[e] + static_cast<double>(counts_E[e])) / n_micro;
  }
}

void quantile_beta_estimate(double* beta_sum_E, double* col_T, const double* logits_TE,
                            const double* keyv_TK1, int64_t n_tok, int64_t E, int64_t K) {
  MOE_CHECK(K >= 1 && K < E && n_tok * K % E == 0,
            "[{}] K={} E={} T={}: needs 1 <= K < E (keyv is a top-(K+1) of E) and T K divisible "
            "by E",
            "quantile_beta_estimate", K, E, n_tok);
  const int64_t n = n_tok, K1 = K + 1;
  const int64_t C = n * K / E;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t t = 0; t < n; ++t) col_T[t] = logits_TE[t * E + e] - keyv_TK1[t * K1 + K];
    std::nth_element(col_T, col_T + C, col_T + n, std::greater<double>());
    beta_sum_E[e] += col_T[C];
  }
}

void divide_in_place(double* x, double d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] /= d;
}

void quantile_beta_update(float* beta_E, double* work_E, const double* avg_E, double ema,
                          int64_t E) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) {
    work_E[e] = ema * beta_E[e] + (1.0 - ema) * avg_E[e];
    mean += work_E[e];
  }
  mean /= static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) beta_E[e] = static_cast<float>(work_E[e] - mean);
}

void expert_bias_update(float* bias_E, const double* counts_E, float rate, int64_t E) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += counts_E[e];
  const double mean = sum / static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double off = mean - counts_E[e];
    const float sign = off > 0 ? 1.0f : (off < 0 ? -1.0f : 0.0f);
    bias_E[e] = bias_E[e] + sign * rate;
  }
}

}  // namespace moecore::ops::cpu
