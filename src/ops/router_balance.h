// Load balancing state of the router: tokens per expert, the step's count accumulators
// (expert bias, global_aux_loss), the quantile-balancing estimate of beta, and the once-per-step
// updates of the fp32 expert bias and quantile beta (docs/router.md, "Once per step").
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void count_tokens_per_expert(int64_t* counts_E, int64_t* seq_counts_BE, const int32_t* idx_TK,
                             int64_t n_tok, int64_t K, int64_t E, int64_t B);
void accumulate_counts(double* sum_E, const int64_t* counts_E, int64_t E);
void running_mean_counts(double* mean_E, const double* sum_E, const int64_t* counts_E,
                         double n_micro, int64_t E);
void quantile_beta_estimate(double* beta_sum_E, double* col_T, const double* logits_TE,
                            const double* keyv_TK1, int64_t n_tok, int64_t E, int64_t K);
void divide_in_place(double* x, double d, int64_t n);
void quantile_beta_update(float* beta_E, double* work_E, const double* avg_E, double ema,
                          int64_t E);
void expert_bias_update(float* bias_E, const double* counts_E, float rate, int64_t E);
}  // namespace cpu

// The CUDA kernels (ops/cuda/router_balance.cu); `stream` is the context's. Counts bitwise the
// CPU's (integer block sums); the sums over E in e order as the CPU's; quantile_beta_estimate
// selects by rank (bitwise the CPU's value, col_T unused). No kernel throws on ids: an expert id
// outside [0, E) is counted nowhere.
namespace cuda {
void count_tokens_per_expert(void* stream, int64_t* counts_E, int64_t* seq_counts_BE,
                             const int32_t* idx_TK, int64_t n_tok, int64_t K, int64_t E, int64_t B);
void accumulate_counts(void* stream, double* sum_E, const int64_t* counts_E, int64_t E);
void running_mean_counts(void* stream, double* mean_E, const double* sum_E, const int64_t* counts_E,
                         double n_micro, int64_t E);
void quantile_beta_estimate(void* stream, double* beta_sum_E, double* col_T,
                            const double* logits_TE, const double* keyv_TK1, int64_t n_tok,
                            int64_t E, int64_t K);
void divide_in_place(void* stream, double* x, double d, int64_t n);
void quantile_beta_update(void* stream, float* beta_E, double* work_E, const double* avg_E,
                          double ema, int64_t E);
void expert_bias_update(void* stream, float* bias_E, const double* counts_E, float rate, int64_t E);
}  // namespace cuda

// counts [E] = the (t, k) with idx = e (negative = dropped, not counted); seq_counts [B, E]
// (null: not computed) the same per sequence b = t mod B. Both assigned.
inline void count_tokens_per_expert(const Exec& ex, DevPtr<int64_t> counts_E,
                                    DevPtr<int64_t> seq_counts_BE, DevPtr<const int32_t> idx_TK,
                                    int64_t n_tok, int64_t K, int64_t E, int64_t B) {
  if (ex.on_cpu())
    return cpu::count_tokens_per_expert(raw_ptr(counts_E), raw_ptr(seq_counts_BE), raw_ptr(idx_TK),
                                        n_tok, K, E, B);
  return cuda::count_tokens_per_expert(ex.stream, raw_ptr(counts_E), raw_ptr(seq_counts_BE),
                                       raw_ptr(idx_TK), n_tok, K, E, B);
}
void count_tokens_per_expert_ref(int64_t* counts_E, int64_t* seq_counts_BE, const int32_t* idx_TK,
                                 int64_t n_tok, int64_t K, int64_t E, int64_t B);

// sum [E] += counts (the step's accumulators, in f64: exact up to 2^53).
inline void accumulate_counts(const Exec& ex, DevPtr<double> sum_E, DevPtr<const int64_t> counts_E,
                              int64_t E) {
  if (ex.on_cpu()) return cpu::accumulate_counts(raw_ptr(sum_E), raw_ptr(counts_E), E);
  return cuda::accumulate_counts(ex.stream, raw_ptr(sum_E), raw_ptr(counts_E), E);
}
void accumulate_counts_ref(double* sum_E, const int64_t* counts_E, int64_t E);

// global_aux_loss's counts: mean [E] = (sum + counts) / n_micro, or sum / n_micro when counts is
// null (a recomputing forward finds its counts already in the sum).
inline void running_mean_counts(const Exec& ex, DevPtr<double> mean_E, DevPtr<const double> sum_E,
                                DevPtr<const int64_t> counts_E, double n_micro, int64_t E) {
  if (ex.on_cpu())
    return cpu::running_mean_counts(raw_ptr(mean_E), raw_ptr(sum_E), raw_ptr(counts_E), n_micro, E);
  return cuda::running_mean_counts(ex.stream, raw_ptr(mean_E), raw_ptr(sum_E), raw_ptr(counts_E),
                                   n_micro, E);
}
void running_mean_counts_ref(double* mean_E, const double* sum_E, const int64_t* counts_E,
                             double n_micro, int64_t E);

// Quantile balancing's per-micro-batch estimate: beta_sum[e] += the (T K / E + 1)-th largest of
// column e of (l - alpha), alpha_t = keyv[t, K] (the (K+1)-th largest of l_t - beta: keyv is a
// top-(K+1) [T, K + 1]). T K divisible by E. col [T] is scratch.
inline void quantile_beta_estimate(const Exec& ex, DevPtr<double> beta_sum_E, DevPtr<double> col_T,
                                   DevPtr<const double> logits_TE, DevPtr<const double> keyv_TK1,
                                   int64_t n_tok, int64_t E, int64_t K) {
  if (ex.on_cpu())
    return cpu::quantile_beta_estimate(raw_ptr(beta_sum_E), raw_ptr(col_T), raw_ptr(logits_TE),
                                       raw_ptr(keyv_TK1), n_tok, E, K);
  return cuda::quantile_beta_estimate(ex.stream, raw_ptr(beta_sum_E), raw_ptr(col_T),
                                      raw_ptr(logits_TE), raw_ptr(keyv_TK1), n_tok, E, K);
}
void quantile_beta_estimate_ref(double* beta_sum_E, const double* logits_TE, const double* keyv_TK1,
                                int64_t n_tok, int64_t E, int64_t K);

// x [n] /= d (the micro-batches' sum of estimates -> their mean).
inline void divide_in_place(const Exec& ex, DevPtr<double> x, double d, int64_t n) {
  if (ex.on_cpu()) return cpu::divide_in_place(raw_ptr(x), d, n);
  return cuda::divide_in_place(ex.stream, raw_ptr(x), d, n);
}
void divide_in_place_ref(double* x, double d, int64_t n);

// beta = ema * beta + (1 - ema) * avg, minus its mean (only differences of beta matter to the
// top-k; centring keeps it from drifting), computed in f64 and stored in fp32. work [E] scratch.
inline void quantile_beta_update(const Exec& ex, DevPtr<float> beta_E, DevPtr<double> work_E,
                                 DevPtr<const double> avg_E, double ema, int64_t E) {
  if (ex.on_cpu())
    return cpu::quantile_beta_update(raw_ptr(beta_E), raw_ptr(work_E), raw_ptr(avg_E), ema, E);
  return cuda::quantile_beta_update(ex.stream, raw_ptr(beta_E), raw_ptr(work_E), raw_ptr(avg_E),
                                    ema, E);
}
void quantile_beta_update_ref(float* beta_E, const double* avg_E, double ema, int64_t E);

// Megatron's get_updated_expert_bias: bias += rate * sign(mean(c) - c), in fp32 like its buffer.
inline void expert_bias_update(const Exec& ex, DevPtr<float> bias_E, DevPtr<const double> counts_E,
                               float rate, int64_t E) {
  if (ex.on_cpu()) return cpu::expert_bias_update(raw_ptr(bias_E), raw_ptr(counts_E), rate, E);
  return cuda::expert_bias_update(ex.stream, raw_ptr(bias_E), raw_ptr(counts_E), rate, E);
}
void expert_bias_update_ref(float* bias_E, const double* counts_E, float rate, int64_t E);

}  // namespace moecore::ops
