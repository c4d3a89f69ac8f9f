// The router's load-balancing and z losses (docs/router.md, "Losses"), their values and their
// gradients: aux_loss E / (K T^2) sum_e P_e N_e with P_e = sum_t a_te (a the aux scores, N the
// counts: this micro-batch's, or global_aux_loss's running mean), seq_aux_loss the same per
// sequence averaged over the B sequences, z-loss mean_t logsumexp(l_t)^2. Values are written to
// a buffer (the step's report), not returned. f64.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename C>
void aux_loss_value(double* value, const double* aux_scores_TE, const C* counts_E, int64_t n_tok,
                    int64_t E, int64_t K);
void seq_aux_loss_value(double* value, const double* aux_scores_TE, const int64_t* seq_counts_BE,
                        int64_t n_tok, int64_t E, int64_t K, int64_t B);
void z_loss_value(double* value, double* lse_T, const double* logits_TE, int64_t n_tok, int64_t E);
template <typename C>
void aux_loss_grad(double* daux_TE, const C* counts_E, double coeff, int64_t n_tok, int64_t E);
void seq_aux_loss_grad(double* daux_TE, const int64_t* seq_counts_BE, double coeff, int64_t n_tok,
                       int64_t E, int64_t B);
void z_loss_grad(double* dlogits_TE, const double* lse_T, const double* softmax_TE, double coeff,
                 int64_t n_tok, int64_t E);
}  // namespace cpu
// The CUDA kernels (ops/cuda/router_losses.cu: the CUDA build, and the grid emulator's tests on
// the CPU); `stream` is the context's. A value is one block's fixed tree written to `value` in
// device memory; the gradients elementwise. Within the f64 tolerance of the references, bitwise
// run to run. The values need T >= 1 (seq_aux: T a multiple of B), as the router calls them.
namespace cuda {
template <typename C>
void aux_loss_value(void* stream, double* value, const double* aux_scores_TE, const C* counts_E,
                    int64_t n_tok, int64_t E, int64_t K);
void seq_aux_loss_value(void* stream, double* value, const double* aux_scores_TE,
                        const int64_t* seq_counts_BE, int64_t n_tok, int64_t E, int64_t K,
                        int64_t B);
void z_loss_value(void* stream, double* value, double* lse_T, const double* logits_TE,
                  int64_t n_tok, int64_t E);
template <typename C>
void aux_loss_grad(void* stream, double* daux_TE, const C* counts_E, double coeff, int64_t n_tok,
                   int64_t E);
void seq_aux_loss_grad(void* stream, double* daux_TE, const int64_t* seq_counts_BE, double coeff,
                       int64_t n_tok, int64_t E, int64_t B);
void z_loss_grad(void* stream, double* dlogits_TE, const double* lse_T, const double* softmax_TE,
                 double coeff, int64_t n_tok, int64_t E);
}  // namespace cuda

// *value = E / (K T^2) sum_e (sum_t a_te) N_e (T = n_tok >= 1); C: int64_t counts of the
// micro-batch or double running means (global_aux_loss).
template <typename C>
void aux_loss_value(const Exec& ex, DevPtr<double> value, DevPtr<const double> aux_scores_TE,
                    DevPtr<const C> counts_E, int64_t n_tok, int64_t E, int64_t K) {
  if (ex.on_cpu())
    return cpu::aux_loss_value(raw_ptr(value), raw_ptr(aux_scores_TE), raw_ptr(counts_E), n_tok, E,
                               K);
  return cuda::aux_loss_value(ex.stream, raw_ptr(value), raw_ptr(aux_scores_TE),
                              raw_ptr(counts_E), n_tok, E, K);
}
template <typename C>
void aux_loss_value_ref(double* value, const double* aux_scores_TE, const C* counts_E,
                        int64_t n_tok, int64_t E, int64_t K);

// *value = 1/B sum_b E / (K S^2) sum_e (sum_{t in b} a_te) N_be: tokens t = s * B + b, S = T / B,
// seq_counts [B, E].
inline void seq_aux_loss_value(const Exec& ex, DevPtr<double> value,
                               DevPtr<const double> aux_scores_TE,
                               DevPtr<const int64_t> seq_counts_BE, int64_t n_tok, int64_t E,
                               int64_t K, int64_t B) {
  if (ex.on_cpu())
    return cpu::seq_aux_loss_value(raw_ptr(value), raw_ptr(aux_scores_TE), raw_ptr(seq_counts_BE),
                                   n_tok, E, K, B);
  return cuda::seq_aux_loss_value(ex.stream, raw_ptr(value), raw_ptr(aux_scores_TE),
                                  raw_ptr(seq_counts_BE), n_tok, E, K, B);
}
void seq_aux_loss_value_ref(double* value, const double* aux_scores_TE,
                            const int64_t* seq_counts_BE, int64_t n_tok, int64_t E, int64_t K,
                            int64_t B);

// lse [T] = logsumexp(logits_t); *value = mean_t lse_t^2 (0 for no tokens).
inline void z_loss_value(const Exec& ex, DevPtr<double> value, DevPtr<double> lse_T,
                         DevPtr<const double> logits_TE, int64_t n_tok, int64_t E) {
  if (ex.on_cpu())
    return cpu::z_loss_value(raw_ptr(value), raw_ptr(lse_T), raw_ptr(logits_TE), n_tok, E);
  return cuda::z_loss_value(ex.stream, raw_ptr(value), raw_ptr(lse_T), raw_ptr(logits_TE), n_tok,
                            E);
}
void z_loss_value_ref(double* value, double* lse_T, const double* logits_TE, int64_t n_tok,
                      int64_t E);

// daux [T, E] += coeff * d(aux value)/d a_te = coeff / T^2 * N_e (coeff includes E / K).
template <typename C>
void aux_loss_grad(const Exec& ex, DevPtr<double> daux_TE, DevPtr<const C> counts_E, double coeff,
                   int64_t n_tok, int64_t E) {
  if (ex.on_cpu()) return cpu::aux_loss_grad(raw_ptr(daux_TE), raw_ptr(counts_E), coeff, n_tok, E);
  return cuda::aux_loss_grad(ex.stream, raw_ptr(daux_TE), raw_ptr(counts_E), coeff, n_tok, E);
}
template <typename C>
void aux_loss_grad_ref(double* daux_TE, const C* counts_E, double coeff, int64_t n_tok, int64_t E);

// daux [T, E] += coeff / (S^2 B) * N_{t mod B, e} (coeff includes E / K).
inline void seq_aux_loss_grad(const Exec& ex, DevPtr<double> daux_TE,
                              DevPtr<const int64_t> seq_counts_BE, double coeff, int64_t n_tok,
                              int64_t E, int64_t B) {
  if (ex.on_cpu())
    return cpu::seq_aux_loss_grad(raw_ptr(daux_TE), raw_ptr(seq_counts_BE), coeff, n_tok, E, B);
  return cuda::seq_aux_loss_grad(ex.stream, raw_ptr(daux_TE), raw_ptr(seq_counts_BE), coeff,
                                 n_tok, E, B);
}
void seq_aux_loss_grad_ref(double* daux_TE, const int64_t* seq_counts_BE, double coeff,
                           int64_t n_tok, int64_t E, int64_t B);

// dlogits [T, E] += coeff * lse_t * softmax(logits_t)_e: the z value's gradient times
// coeff * T / 2 (the caller passes coeff = scale * z_coeff * 2 / T).
inline void z_loss_grad(const Exec& ex, DevPtr<double> dlogits_TE, DevPtr<const double> lse_T,
                        DevPtr<const double> softmax_TE, double coeff, int64_t n_tok, int64_t E) {
  if (ex.on_cpu())
    return cpu::z_loss_grad(raw_ptr(dlogits_TE), raw_ptr(lse_T), raw_ptr(softmax_TE), coeff, n_tok,
                            E);
  return cuda::z_loss_grad(ex.stream, raw_ptr(dlogits_TE), raw_ptr(lse_T), raw_ptr(softmax_TE),
                           coeff, n_tok, E);
}
void z_loss_grad_ref(double* dlogits_TE, const double* lse_T, const double* softmax_TE,
                     double coeff, int64_t n_tok, int64_t E);

}  // namespace moecore::ops
