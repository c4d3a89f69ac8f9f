// Routing probabilities fast path: OpenMP over tokens (rows are independent and each is summed
// in k order), so the bits do not depend on the thread count. SoftmaxOverE's backward is a
// scatter into [T, E] and ops/softmax_topk's softmax backward.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/cpu/router_math.h"
#include "ops/router_probs.h"
#include "ops/softmax_topk.h"

namespace moecore::ops::cpu {

namespace {
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

void gather_topk(double* val_TK, const double* src_TE, const int32_t* idx_TK, int64_t n_tok,
                 int64_t E, int64_t K) {
#pragma omp parallel for schedule(static) if (n_tok * K >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t k = 0; k < K; ++k) val_TK[t * K + k] = src_TE[t * E + idx_TK[t * K + k]];
  }
}

void topk_probs(ProbsFn fn, double* probs_TK, const double* val_TK, double scale, int64_t n_tok,
                int64_t K) {
#pragma omp parallel for schedule(static) if (n_tok * K >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* v = val_TK + t * K;
    double* p = probs_TK + t * K;
    if (fn == ProbsFn::SoftmaxOverK) {
      double m = v[0], z = 0;  // v is in descending order of the key, not necessarily of v
      for (int64_t k = 1; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      for (int64_t k = 0; k < K; ++k) p[k] = std::exp(v[k] - m) / z;
    } else if (fn == ProbsFn::Normalized && K > 1) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      for (int64_t k = 0; k < K; ++k) p[k] = v[k] / (sum + kRouterNormEps);
    } else {
      for (int64_t k = 0; k < K; ++k) p[k] = v[k];
    }
    for (int64_t k = 0; k < K; ++k) p[k] *= scale;
  }
}

template <typename T>
void kept_prob_grads(double* g_TK, const T* dprobs_TK, const int32_t* idx_TK, double scale,
                     int64_t TK) {
#pragma omp parallel for schedule(static) if (TK >= kParallelMin)
  for (int64_t i = 0; i < TK; ++i) {
    g_TK[i] = idx_TK[i] >= 0 ? static_cast<double>(dprobs_TK[i]) * scale : 0;
  }
}

void topk_probs_backward(ProbsFn fn, ScoreFn score, double* dlogits_TE, double* work_TE,
                         const double* g_TK, const double* val_TK, const int32_t* routed_TK,
                         const double* logits_TE, const double* scores_TE, int64_t n_tok,
                         int64_t E, int64_t K) {
  double* dl = dlogits_TE;
  if (fn == ProbsFn::SoftmaxOverE) {
    // p = the softmax over E at the chosen experts: scatter, then the softmax backward.
    std::memset(work_TE, 0, sizeof(double) * n_tok * E);
    for (int64_t t = 0; t < n_tok; ++t) {
      for (int64_t k = 0; k < K; ++k) work_TE[t * E + routed_TK[t * K + k]] += g_TK[t * K + k];
    }
    softmax_backward(work_TE, work_TE, scores_TE, n_tok, E);
    const int64_t n = n_tok * E;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) dl[i] += work_TE[i];
    return;
  }
  // Each token writes only its own row of dlogits.
#pragma omp parallel for schedule(static) if (n_tok * K >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* v = val_TK + t * K;
    const double* g = g_TK + t * K;
    const int32_t* idx = routed_TK + t * K;
    if (fn == ProbsFn::SoftmaxOverK) {
      // p = softmax(v) over K, recomputed unscaled.
      double m = v[0], z = 0, dot = 0;
      for (int64_t k = 1; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      for (int64_t k = 0; k < K; ++k) dot += g[k] * std::exp(v[k] - m) / z;
      for (int64_t k = 0; k < K; ++k) dl[t * E + idx[k]] += std::exp(v[k] - m) / z * (g[k] - dot);
    } else if (fn == ProbsFn::SigmoidTop1) {
      dl[t * E + idx[0]] += g[0] * v[0] * (1.0 - v[0]);
    } else {
      // Normalized: p = v / (sum v + eps) for K > 1, else v.
      double sum = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      const double den = sum + kRouterNormEps;
      for (int64_t k = 0; k < K; ++k) dot += g[k] * v[k];
      for (int64_t k = 0; k < K; ++k) {
        const double dv = K > 1 ? g[k] / den - dot / (den * den) : g[k];
        const int64_t te = t * E + idx[k];
        dl[te] += dv * router_math::dscore_dlogit(score, logits_TE[te], scores_TE[te]);
      }
    }
  }
}

template void kept_prob_grads<float>(double*, const float*, const int32_t*, double, int64_t);
template void kept_prob_grads<double>(double*, const double*, const int32_t*, double, int64_t);

}  // namespace moecore::ops::cpu
