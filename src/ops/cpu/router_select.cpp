// Router selection fast path: OpenMP over tokens where rows are independent (the key, the group
// mask); Sinkhorn's sums and the capacity sort stay serial in the reference's order, so every
// result is bitwise the same for any thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "core/check.h"
#include "ops/router_select.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
// Megatron's Sinkhorn: stop when mean |d1 change| <= tol; eps guards the divisions.
constexpr double kSinkhornTol = 1e-4;
constexpr double kSinkhornEps = 1e-8;
constexpr int kSinkhornMaxIters = 100000;
constexpr int64_t kMaxGroups = 256;
}  // namespace

void routing_key(double* key_TE, const double* src_TE, const float* offset_E, bool subtract,
                 int64_t n_tok, int64_t E) {
  if (!offset_E) {
    if (key_TE != src_TE) std::memcpy(key_TE, src_TE, sizeof(double) * n_tok * E);
    return;
  }
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* s = src_TE + t * E;
    double* k = key_TE + t * E;
    if (subtract) {
      for (int64_t e = 0; e < E; ++e) k[e] = s[e] - offset_E[e];
    } else {
      for (int64_t e = 0; e < E; ++e) k[e] = s[e] + offset_E[e];
    }
  }
}

void group_limited_mask(double* key_TE, double* scratch_TE, int64_t n_tok, int64_t E,
                        int64_t num_groups, int64_t group_topk, int64_t K) {
  const int64_t G = num_groups, g = group_topk, per = E / G, kg = K / g;
  MOE_CHECK(G >= 1 && G <= kMaxGroups && E % G == 0 && g >= 1 && g <= G && K % g == 0 &&
                kg <= per,
            "[group_limited_mask] num_groups={} group_topk={} topk={} num_experts={}: need "
            "num_groups in [1, {}] dividing num_experts, group_topk in [1, num_groups] dividing "
            "topk, topk / group_topk <= num_experts / num_groups",
            G, g, K, E, kMaxGroups);
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    double* key = key_TE + t * E;
    double* row = scratch_TE + t * E;  // a copy, partially sorted per group
    std::memcpy(row, key, sizeof(double) * E);
    double group_score[kMaxGroups];
    for (int64_t j = 0; j < G; ++j) {
      double* seg = row + j * per;
      std::partial_sort(seg, seg + kg, seg + per, std::greater<double>());
      double sum = 0;
      for (int64_t i = 0; i < kg; ++i) sum += seg[i];
      group_score[j] = sum;
    }
    // Pick g groups, best first, ties to the lower group; picked groups are marked by NaN.
    uint64_t keep_bits[kMaxGroups / 64] = {0, 0, 0, 0};
    for (int64_t r = 0; r < g; ++r) {
      int64_t best = -1;
      for (int64_t j = 0; j < G; ++j) {
        if (std::isnan(group_score[j])) continue;
        if (best < 0 || group_score[j] > group_score[best]) best = j;
      }
      keep_bits[best / 64] |= uint64_t(1) << (best % 64);
      group_score[best] = NAN;
    }
    for (int64_t j = 0; j < G; ++j) {
      if (keep_bits[j / 64] >> (j % 64) & 1) continue;
      for (int64_t i = 0; i < per; ++i) key[j * per + i] = -INFINITY;
    }
  }
}

// The sums' products are explicit fused multiply-adds: GCC contracts a * b + acc in a loop's scalar
// remainder but not in its vectorised body, so the bits depended on the vectorisation; std::fma
// gives one rounding on every ISA, here, in the reference and in the CUDA kernel.
void sinkhorn_balance(double* cost_TE, double* d0_T, double* d1_2E, const double* logits_TE,
                      int64_t n_tok, int64_t E) {
  const int64_t n = n_tok;
  double* cost = cost_TE;
  for (int64_t i = 0; i < n * E; ++i) cost[i] = std::exp(logits_TE[i]);
  double* d0 = d0_T;
  double* d1 = d1_2E;
  double* d1_old = d1_2E + E;
  for (int64_t t = 0; t < n; ++t) d0[t] = 1.0;
  for (int64_t e = 0; e < E; ++e) d1[e] = d1_old[e] = 1.0;
  double error = 1e9;
  int iters = 0;
  while (error > kSinkhornTol) {
    MOE_CHECK(++iters <= kSinkhornMaxIters,
              "[router] sinkhorn did not converge in {} iterations (error {}): the router logits "
              "are degenerate",
              kSinkhornMaxIters, error);
    for (int64_t t = 0; t < n; ++t) {
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) acc = std::fma(d1[e], cost[t * E + e], acc);
      d0[t] = (1.0 / static_cast<double>(n)) * 1.0 / (acc + kSinkhornEps);
    }
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t t = 0; t < n; ++t) acc = std::fma(d0[t], cost[t * E + e], acc);
      d1[e] = (1.0 / static_cast<double>(E)) * 1.0 / (acc + kSinkhornEps);
    }
    error = 0;
    for (int64_t e = 0; e < E; ++e) error += std::abs(d1_old[e] - d1[e]);
    error /= static_cast<double>(E);
    std::memcpy(d1_old, d1, sizeof(double) * E);
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) cost[t * E + e] *= d1[e] * d0[t];
  }
}

void topk_prefix(int32_t* idx_TK, const int32_t* idx_TK1, int64_t n_tok, int64_t K, int64_t K1) {
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t k = 0; k < K; ++k) idx_TK[t * K + k] = idx_TK1[t * K1 + k];
  }
}

void apply_capacity(int32_t* idx_TK, double* probs_TK, int64_t* dropped, int32_t* cand_N,
                    int64_t* cand_off_2E1, const int32_t* routed_TK, int64_t n_tok, int64_t K,
                    int64_t E, int64_t capacity, bool by_probs) {
  const int64_t TK = n_tok * K, cap = capacity;
  std::memcpy(idx_TK, routed_TK, sizeof(int32_t) * TK);
  *dropped = 0;
  if (cap <= 0) return;
  // Counting sort of the pairs by expert, token order within an expert.
  int64_t* off = cand_off_2E1;
  std::fill(off, off + E + 1, 0);
  for (int64_t i = 0; i < TK; ++i) ++off[routed_TK[i] + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  int64_t* fill = off + E + 1;  // E cursors
  for (int64_t e = 0; e < E; ++e) fill[e] = off[e];
  for (int64_t i = 0; i < TK; ++i) cand_N[fill[routed_TK[i]]++] = static_cast<int32_t>(i);
  const double* p = probs_TK;
  int64_t n_dropped = 0;
  for (int64_t e = 0; e < E; ++e) {
    int32_t* b = cand_N + off[e];
    int32_t* end = cand_N + off[e + 1];
    if (end - b <= cap) continue;
    if (by_probs) {
      std::sort(b, end,
                [p](int32_t i, int32_t j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
    }
    for (int32_t* it = b + cap; it < end; ++it) {
      idx_TK[*it] = -1;
      probs_TK[*it] = 0.0;
      ++n_dropped;
    }
  }
  *dropped = n_dropped;
}

}  // namespace moecore::ops::cpu
