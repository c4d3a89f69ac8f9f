// Router score functions reference: plain loops over (t, e), the softmax written out. The oracle
// for router_scores.cpp.
#include <algorithm>
#include <cmath>

#include "ops/cpu/router_math.h"
#include "ops/router_scores.h"

namespace moecore::ops {

void router_scores_ref(ScoreFn fn, double* scores_TE, double* aux_scores_TE,
                       const double* logits_TE, int64_t n_tok, int64_t E) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* l = logits_TE + t * E;
    double* sc = scores_TE + t * E;
    if (fn == ScoreFn::Softmax) {
      double m = -INFINITY, z = 0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
      for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
      for (int64_t e = 0; e < E; ++e) sc[e] = std::exp(l[e] - m) / z;
      if (aux_scores_TE) {
        for (int64_t e = 0; e < E; ++e) aux_scores_TE[t * E + e] = sc[e];
      }
      continue;
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      sc[e] = router_math::score(fn, l[e]);
      sum += sc[e];
    }
    if (aux_scores_TE) {
      for (int64_t e = 0; e < E; ++e) aux_scores_TE[t * E + e] = sc[e] / (sum + kRouterNormEps);
    }
  }
}

void aux_scores_backward_ref(ScoreFn fn, double* dlogits_TE, double* daux_TE,
                             const double* aux_scores_TE, const double* scores_TE,
                             const double* logits_TE, int64_t n_tok, int64_t E) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* g = daux_TE + t * E;
    double* dl = dlogits_TE + t * E;
    if (fn == ScoreFn::Softmax) {
      // d a_e / d l_j = a_e (delta_ej - a_j).
      const double* a = aux_scores_TE + t * E;
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += g[e] * a[e];
      for (int64_t e = 0; e < E; ++e) dl[e] += a[e] * (g[e] - dot);
      continue;
    }
    // a_e = s_e / (sum s + eps): d a_e / d s_j = delta_ej / den - s_e / den^2.
    const double* sc = scores_TE + t * E;
    const double* l = logits_TE + t * E;
    double sum = 0, dot = 0;
    for (int64_t e = 0; e < E; ++e) sum += sc[e];
    const double den = sum + kRouterNormEps;
    for (int64_t e = 0; e < E; ++e) dot += g[e] * sc[e];
    for (int64_t e = 0; e < E; ++e) {
      const double ds = g[e] / den - dot / (den * den);
      dl[e] += ds * router_math::dscore_dlogit(fn, l[e], sc[e]);
    }
  }
}

}  // namespace moecore::ops
