// Router selection reference: plain loops; group scores from a full sort of each group, the
// capacity by repeated selection of the best remaining pair of each expert (O(E (T K)^2)).
// The oracle for router_select.cpp.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/check.h"
#include "ops/router_select.h"

namespace moecore::ops {

void routing_key_ref(double* key_TE, const double* src_TE, const float* offset_E, bool subtract,
                     int64_t n_tok, int64_t E) {
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double off = offset_E ? static_cast<double>(offset_E[e]) : 0.0;
      const double s = src_TE[t * E + e];
      key_TE[t * E + e] = !offset_E ? s : (subtract ? s - off : s + off);
    }
  }
}

void group_limited_mask_ref(double* key_TE, int64_t n_tok, int64_t E, int64_t num_groups,
                            int64_t group_topk, int64_t K) {
  const int64_t G = num_groups, per = E / G, kg = K / group_topk;
  for (int64_t t = 0; t < n_tok; ++t) {
    double* key = key_TE + t * E;
    std::vector<double> score(G);
    for (int64_t j = 0; j < G; ++j) {
      std::vector<double> seg(key + j * per, key + (j + 1) * per);
      std::sort(seg.begin(), seg.end(), std::greater<double>());
      double sum = 0;
      for (int64_t i = 0; i < kg; ++i) sum += seg[i];
      score[j] = sum;
    }
    // Group j stays iff fewer than group_topk groups beat it (greater score, or equal score
    // and a lower index).
    std::vector<bool> keep(G);
    for (int64_t j = 0; j < G; ++j) {
      int64_t better = 0;
      for (int64_t i = 0; i < G; ++i) {
        if (score[i] > score[j] || (score[i] == score[j] && i < j)) ++better;
      }
      keep[j] = better < group_topk;
    }
    for (int64_t e = 0; e < E; ++e) {
      if (!keep[e / per]) key[e] = -INFINITY;
    }
  }
}

// The products fused into the sums (std::fma), as the fast path and the CUDA kernel do.
void sinkhorn_balance_ref(double* cost_TE, double* d0_T, double* d1_2E, const double* logits_TE,
                          int64_t n_tok, int64_t E) {
  const int64_t n = n_tok;
  for (int64_t i = 0; i < n * E; ++i) cost_TE[i] = std::exp(logits_TE[i]);
  std::vector<double> d0(n, 1.0), d1(E, 1.0), d1_old(E, 1.0);
  double error = 1e9;
  int iters = 0;
  while (error > 1e-4) {
    MOE_CHECK(++iters <= 100000, "[router] sinkhorn did not converge (error {})", error);
    for (int64_t t = 0; t < n; ++t) {
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) acc = std::fma(d1[e], cost_TE[t * E + e], acc);
      d0[t] = (1.0 / static_cast<double>(n)) * 1.0 / (acc + 1e-8);
    }
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t t = 0; t < n; ++t) acc = std::fma(d0[t], cost_TE[t * E + e], acc);
      d1[e] = (1.0 / static_cast<double>(E)) * 1.0 / (acc + 1e-8);
    }
    error = 0;
    for (int64_t e = 0; e < E; ++e) error += std::abs(d1_old[e] - d1[e]);
    error /= static_cast<double>(E);
    d1_old = d1;
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) cost_TE[t * E + e] *= d1[e] * d0[t];
  }
  for (int64_t t = 0; t < n; ++t) d0_T[t] = d0[t];
  for (int64_t e = 0; e < E; ++e) d1_2E[e] = d1_2E[E + e] = d1[e];
}

void topk_prefix_ref(int32_t* idx_TK, const int32_t* idx_TK1, int64_t n_tok, int64_t K,
                     int64_t K1) {
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t k = 0; k < K; ++k) idx_TK[t * K + k] = idx_TK1[t * K1 + k];
  }
}

void apply_capacity_ref(int32_t* idx_TK, double* probs_TK, int64_t* dropped,
                        const int32_t* routed_TK, int64_t n_tok, int64_t K, int64_t E,
                        int64_t capacity, bool by_probs) {
  const int64_t TK = n_tok * K;
  for (int64_t i = 0; i < TK; ++i) idx_TK[i] = routed_TK[i];
  *dropped = 0;
  if (capacity <= 0) return;
  const std::vector<double> p(probs_TK, probs_TK + TK);  // the probs before any drop
  for (int64_t e = 0; e < E; ++e) {
    std::vector<bool> kept(TK, false);
    for (int64_t c = 0; c < capacity; ++c) {  // keep the best remaining pair, capacity times
      int64_t best = -1;
      for (int64_t i = 0; i < TK; ++i) {
        if (routed_TK[i] != e || kept[i]) continue;
        if (best < 0 || (by_probs && p[i] > p[best])) best = i;
      }
      if (best < 0) break;
      kept[best] = true;
    }
    for (int64_t i = 0; i < TK; ++i) {
      if (routed_TK[i] == e && !kept[i]) {
        idx_TK[i] = -1;
        probs_TK[i] = 0.0;
        ++*dropped;
      }
    }
  }
}

}  // namespace moecore::ops
