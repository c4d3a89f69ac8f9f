// Router score functions over the E experts of each token and their backward: softmax, sigmoid,
// sqrt(softplus); the aux-loss scores (softmax, or s / (sum_E s + eps) for the elementwise
// functions). f64: the router math after the gate GEMM is f64 (docs/router.md).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

// --moe-router-score-function.
enum class ScoreFn { Softmax, Sigmoid, SqrtSoftplus };

// Megatron's epsilon in the sigmoid / sqrtsoftplus normalisations (issue #1545: it lets the aux
// loss dip below its floor; we keep it for parity, it is far below f64 resolution of 1).
inline constexpr double kRouterNormEps = 1e-20;

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void router_scores(ScoreFn fn, double* scores_TE, double* aux_scores_TE, const double* logits_TE,
                   int64_t n_tok, int64_t E);
void aux_scores_backward(ScoreFn fn, double* dlogits_TE, double* daux_TE,
                         const double* aux_scores_TE, const double* scores_TE,
                         const double* logits_TE, int64_t n_tok, int64_t E);
}  // namespace cpu
// The CUDA kernels (ops/cuda/router_scores.cu); `stream` is the context's. The switches below call
// them where the build has kernels.
namespace cuda {
void router_scores(void* stream, ScoreFn fn, double* scores_TE, double* aux_scores_TE,
                   const double* logits_TE, int64_t n_tok, int64_t E);
void aux_scores_backward(void* stream, ScoreFn fn, double* dlogits_TE, double* daux_TE,
                         const double* aux_scores_TE, const double* scores_TE,
                         const double* logits_TE, int64_t n_tok, int64_t E);
}  // namespace cuda

// scores [T, E] = fn(logits) per row (softmax over E, or sigmoid / sqrt(softplus) per element);
// aux_scores [T, E] (may be null: not computed) = the aux-loss scores: the softmax itself, or
// s / (sum_E s + kRouterNormEps) (Megatron normalises them for every K). scores may alias logits
// when aux_scores is null.
inline void router_scores(const Exec& ex, ScoreFn fn, DevPtr<double> scores_TE,
                          DevPtr<double> aux_scores_TE, DevPtr<const double> logits_TE,
                          int64_t n_tok, int64_t E) {
  if (ex.on_cpu())
    return cpu::router_scores(fn, raw_ptr(scores_TE), raw_ptr(aux_scores_TE), raw_ptr(logits_TE),
                              n_tok, E);
  return cuda::router_scores(ex.stream, fn, raw_ptr(scores_TE), raw_ptr(aux_scores_TE),
                             raw_ptr(logits_TE), n_tok, E);
}
void router_scores_ref(ScoreFn fn, double* scores_TE, double* aux_scores_TE,
                       const double* logits_TE, int64_t n_tok, int64_t E);

// Backward of the aux scores: dlogits += d(aux scores)/d(logits)^T daux (daux [T, E], the
// gradient w.r.t. the aux scores, is used as scratch and left unspecified). Softmax: through
// aux_scores (= the softmax); elementwise: through the normalisation and fn, from scores and
// logits.
inline void aux_scores_backward(const Exec& ex, ScoreFn fn, DevPtr<double> dlogits_TE,
                                DevPtr<double> daux_TE, DevPtr<const double> aux_scores_TE,
                                DevPtr<const double> scores_TE, DevPtr<const double> logits_TE,
                                int64_t n_tok, int64_t E) {
  if (ex.on_cpu())
    return cpu::aux_scores_backward(fn, raw_ptr(dlogits_TE), raw_ptr(daux_TE),
                                    raw_ptr(aux_scores_TE), raw_ptr(scores_TE), raw_ptr(logits_TE),
                                    n_tok, E);
  return cuda::aux_scores_backward(ex.stream, fn, raw_ptr(dlogits_TE), raw_ptr(daux_TE),
                                   raw_ptr(aux_scores_TE), raw_ptr(scores_TE),
                                   raw_ptr(logits_TE), n_tok, E);
}
void aux_scores_backward_ref(ScoreFn fn, double* dlogits_TE, double* daux_TE,
                             const double* aux_scores_TE, const double* scores_TE,
                             const double* logits_TE, int64_t n_tok, int64_t E);

}  // namespace moecore::ops
