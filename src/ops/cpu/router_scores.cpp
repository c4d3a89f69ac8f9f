// Router score functions fast path: OpenMP over tokens (each row is independent and summed in
// e order, so the bits do not depend on the thread count); softmax is ops/softmax_topk's.
#include <cstring>

#include "ops/cpu/router_math.h"
#include "ops/router_scores.h"
#include "ops/softmax_topk.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

void router_scores(ScoreFn fn, double* scores_TE, double* aux_scores_TE, const double* logits_TE,
                   int64_t n_tok, int64_t E) {
  if (fn == ScoreFn::Softmax) {
    softmax_forward(scores_TE, logits_TE, n_tok, E);
    if (aux_scores_TE) std::memcpy(aux_scores_TE, scores_TE, sizeof(double) * n_tok * E);
    return;
  }
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* l = logits_TE + t * E;
    double* sc = scores_TE + t * E;
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      sc[e] = router_math::score(fn, l[e]);
      sum += sc[e];
    }
    if (!aux_scores_TE) continue;
    double* a = aux_scores_TE + t * E;
    for (int64_t e = 0; e < E; ++e) a[e] = sc[e] / (sum + kRouterNormEps);
  }
}

void aux_scores_backward(ScoreFn fn, double* dlogits_TE, double* daux_TE,
                         const double* aux_scores_TE, const double* scores_TE,
                         const double* logits_TE, int64_t n_tok, int64_t E) {
  if (fn == ScoreFn::Softmax) {
    softmax_backward(daux_TE, daux_TE, aux_scores_TE, n_tok, E);
    const int64_t n = n_tok * E;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) dlogits_TE[i] += daux_TE[i];
    return;
  }
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* sc = scores_TE + t * E;
    const double* l = logits_TE + t * E;
    const double* g = daux_TE + t * E;
    double* dl = dlogits_TE + t * E;
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

}  // namespace moecore::ops::cpu
