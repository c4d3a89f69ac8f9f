// The routing probabilities at the chosen experts and their backward: gather the values they
// derive from (the selected logits or scores), then softmax over the K selected logits,
// s / (sum_K s + eps) for the elementwise score functions, or the scores as they are; times the
// scaling factor. The backward undoes the scaling, skips dropped slots and goes through the same
// formula to the logits. f64 (docs/router.md).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/router_scores.h"

namespace moecore::ops {

// How the probs follow from the gathered values v [T, K] (docs/router.md, "Selection"):
enum class ProbsFn {
  SoftmaxOverK,  // v = logits at the chosen experts; p = softmax(v) over K
  SoftmaxOverE,  // v = softmax(logits) over E at the chosen experts (pre-softmax, sinkhorn K > 1)
  Normalized,    // v = sigmoid / sqrtsoftplus scores; p = v / (sum_K v + eps) if K > 1, else v
  SigmoidTop1,   // v = sigmoid(logit) of the one chosen expert (sinkhorn, K = 1)
};

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void gather_topk(double* val_TK, const double* src_TE, const int32_t* idx_TK, int64_t n_tok,
                 int64_t E, int64_t K);
void topk_probs(ProbsFn fn, double* probs_TK, const double* val_TK, double scale, int64_t n_tok,
                int64_t K);
template <typename T>
void kept_prob_grads(double* g_TK, const T* dprobs_TK, const int32_t* idx_TK, double scale,
                     int64_t TK);
void topk_probs_backward(ProbsFn fn, ScoreFn score, double* dlogits_TE, double* work_TE,
                         const double* g_TK, const double* val_TK, const int32_t* routed_TK,
                         const double* logits_TE, const double* scores_TE, int64_t n_tok, int64_t E,
                         int64_t K);
}  // namespace cpu
// The CUDA kernels (ops/cuda/router_probs.cu: the CUDA build, and the grid emulator's tests on the
// CPU); `stream` is the context's. The gather and kept_prob_grads bitwise the CPU's; the probs and
// the backward within the f64 tolerance of the references (the device's exp; SoftmaxOverE's dot in
// a fixed block tree), bitwise run to run.
namespace cuda {
void gather_topk(void* stream, double* val_TK, const double* src_TE, const int32_t* idx_TK,
                 int64_t n_tok, int64_t E, int64_t K);
void topk_probs(void* stream, ProbsFn fn, double* probs_TK, const double* val_TK, double scale,
                int64_t n_tok, int64_t K);
template <typename T>
void kept_prob_grads(void* stream, double* g_TK, const T* dprobs_TK, const int32_t* idx_TK,
                     double scale, int64_t TK);
void topk_probs_backward(void* stream, ProbsFn fn, ScoreFn score, double* dlogits_TE,
                         double* work_TE, const double* g_TK, const double* val_TK,
                         const int32_t* routed_TK, const double* logits_TE,
                         const double* scores_TE, int64_t n_tok, int64_t E, int64_t K);
}  // namespace cuda

// val[t, k] = src[t, idx[t, k]] (idx >= 0).
inline void gather_topk(const Exec& ex, DevPtr<double> val_TK, DevPtr<const double> src_TE,
                        DevPtr<const int32_t> idx_TK, int64_t n_tok, int64_t E, int64_t K) {
  if (ex.on_cpu())
    return cpu::gather_topk(raw_ptr(val_TK), raw_ptr(src_TE), raw_ptr(idx_TK), n_tok, E, K);
  return cuda::gather_topk(ex.stream, raw_ptr(val_TK), raw_ptr(src_TE), raw_ptr(idx_TK), n_tok,
                           E, K);
}
void gather_topk_ref(double* val_TK, const double* src_TE, const int32_t* idx_TK, int64_t n_tok,
                     int64_t E, int64_t K);

// probs [T, K] = fn's probs of val, times scale (--moe-router-topk-scaling-factor, 1: none).
inline void topk_probs(const Exec& ex, ProbsFn fn, DevPtr<double> probs_TK,
                       DevPtr<const double> val_TK, double scale, int64_t n_tok, int64_t K) {
  if (ex.on_cpu()) return cpu::topk_probs(fn, raw_ptr(probs_TK), raw_ptr(val_TK), scale, n_tok, K);
  return cuda::topk_probs(ex.stream, fn, raw_ptr(probs_TK), raw_ptr(val_TK), scale, n_tok, K);
}
void topk_probs_ref(ProbsFn fn, double* probs_TK, const double* val_TK, double scale, int64_t n_tok,
                    int64_t K);

// g [T, K] = dprobs * scale where idx >= 0, 0 at dropped slots (their prob is the constant 0).
template <typename T>
void kept_prob_grads(const Exec& ex, DevPtr<double> g_TK, DevPtr<const T> dprobs_TK,
                     DevPtr<const int32_t> idx_TK, double scale, int64_t TK) {
  if (ex.on_cpu())
    return cpu::kept_prob_grads(raw_ptr(g_TK), raw_ptr(dprobs_TK), raw_ptr(idx_TK), scale, TK);
  return cuda::kept_prob_grads(ex.stream, raw_ptr(g_TK), raw_ptr(dprobs_TK), raw_ptr(idx_TK),
                               scale, TK);
}
template <typename T>
void kept_prob_grads_ref(double* g_TK, const T* dprobs_TK, const int32_t* idx_TK, double scale,
                         int64_t TK);

// dlogits [T, E] += the gradient of sum g * probs/scale through fn (g: kept_prob_grads'), with
// val and routed (before dropping) the forward's; scores [T, E] are the score function's (the
// softmax for SoftmaxOverE), logits [T, E] the gate's. work [T, E] is scratch (SoftmaxOverE).
inline void topk_probs_backward(const Exec& ex, ProbsFn fn, ScoreFn score,
                                DevPtr<double> dlogits_TE, DevPtr<double> work_TE,
                                DevPtr<const double> g_TK, DevPtr<const double> val_TK,
                                DevPtr<const int32_t> routed_TK, DevPtr<const double> logits_TE,
                                DevPtr<const double> scores_TE, int64_t n_tok, int64_t E,
                                int64_t K) {
  if (ex.on_cpu())
    return cpu::topk_probs_backward(fn, score, raw_ptr(dlogits_TE), raw_ptr(work_TE), raw_ptr(g_TK),
                                    raw_ptr(val_TK), raw_ptr(routed_TK), raw_ptr(logits_TE),
                                    raw_ptr(scores_TE), n_tok, E, K);
  return cuda::topk_probs_backward(ex.stream, fn, score, raw_ptr(dlogits_TE), raw_ptr(work_TE),
                                   raw_ptr(g_TK), raw_ptr(val_TK), raw_ptr(routed_TK),
                                   raw_ptr(logits_TE), raw_ptr(scores_TE), n_tok, E, K);
}
void topk_probs_backward_ref(ProbsFn fn, ScoreFn score, double* dlogits_TE, const double* g_TK,
                             const double* val_TK, const int32_t* routed_TK,
                             const double* logits_TE, const double* scores_TE, int64_t n_tok,
                             int64_t E, int64_t K);

}  // namespace moecore::ops
