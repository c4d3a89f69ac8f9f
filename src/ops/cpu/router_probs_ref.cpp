// Routing probabilities reference: plain loops; the backward from the Jacobian of each formula
// written out entry by entry (the softmax over E one included). The oracle for router_probs.cpp.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/router_math.h"
#include "ops/router_probs.h"

namespace moecore::ops {

void gather_topk_ref(double* val_TK, const double* src_TE, const int32_t* idx_TK, int64_t n_tok,
                     int64_t E, int64_t K) {
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t k = 0; k < K; ++k) val_TK[t * K + k] = src_TE[t * E + idx_TK[t * K + k]];
  }
}

void topk_probs_ref(ProbsFn fn, double* probs_TK, const double* val_TK, double scale,
                    int64_t n_tok, int64_t K) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* v = val_TK + t * K;
    double m = -INFINITY, z = 0, sum = 0;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, v[k]);
    for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
    for (int64_t k = 0; k < K; ++k) sum += v[k];
    for (int64_t k = 0; k < K; ++k) {
      double p = v[k];
      if (fn == ProbsFn::SoftmaxOverK) p = std::exp(v[k] - m) / z;
      if (fn == ProbsFn::Normalized && K > 1) p = v[k] / (sum + kRouterNormEps);
      probs_TK[t * K + k] = p * scale;
    }
  }
}

template <typename T>
void kept_prob_grads_ref(double* g_TK, const T* dprobs_TK, const int32_t* idx_TK, double scale,
                         int64_t TK) {
  for (int64_t i = 0; i < TK; ++i) {
    g_TK[i] = idx_TK[i] < 0 ? 0.0 : static_cast<double>(dprobs_TK[i]) * scale;
  }
}

void topk_probs_backward_ref(ProbsFn fn, ScoreFn score, double* dlogits_TE, const double* g_TK,
                             const double* val_TK, const int32_t* routed_TK,
                             const double* logits_TE, const double* scores_TE, int64_t n_tok,
                             int64_t E, int64_t K) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* v = val_TK + t * K;
    const double* g = g_TK + t * K;
    const int32_t* idx = routed_TK + t * K;
    double* dl = dlogits_TE + t * E;
    if (fn == ProbsFn::SoftmaxOverE) {
      // v_k = s_{idx_k}, s = softmax(l): d s_i / d l_j = s_i (delta_ij - s_j).
      const double* s = scores_TE + t * E;
      for (int64_t j = 0; j < E; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t i = idx[k];
          acc += g[k] * s[i] * ((i == j ? 1.0 : 0.0) - s[j]);
        }
        dl[j] += acc;
      }
    } else if (fn == ProbsFn::SoftmaxOverK) {
      // p = softmax(v): d p_k / d v_j = p_k (delta_kj - p_j), and v_j = l_{idx_j}.
      double m = -INFINITY, z = 0;
      for (int64_t k = 0; k < K; ++k) m = std::max(m, v[k]);
      for (int64_t k = 0; k < K; ++k) z += std::exp(v[k] - m);
      std::vector<double> p(K);
      for (int64_t k = 0; k < K; ++k) p[k] = std::exp(v[k] - m) / z;
      for (int64_t j = 0; j < K; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += g[k] * p[k] * ((k == j ? 1.0 : 0.0) - p[j]);
        dl[idx[j]] += acc;
      }
    } else if (fn == ProbsFn::SigmoidTop1) {
      dl[idx[0]] += g[0] * v[0] * (1.0 - v[0]);
    } else {
      // p_k = v_k / den (K > 1): d p_k / d v_j = delta_kj / den - v_k / den^2.
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += v[k];
      const double den = sum + kRouterNormEps;
      for (int64_t j = 0; j < K; ++j) {
        double dv = g[j];
        if (K > 1) {
          dv = 0;
          for (int64_t k = 0; k < K; ++k) {
            dv += g[k] * ((k == j ? 1.0 : 0.0) / den - v[k] / (den * den));
          }
        }
        const int64_t e = idx[j];
        dl[e] += dv * router_math::dscore_dlogit(score, logits_TE[t * E + e], scores_TE[t * E + e]);
      }
    }
  }
}

template void kept_prob_grads_ref<float>(double*, const float*, const int32_t*, double, int64_t);
template void kept_prob_grads_ref<double>(double*, const double*, const int32_t*, double,
                                          int64_t);

}  // namespace moecore::ops
