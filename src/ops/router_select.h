// Router selection: the key the top-k runs on (expert bias added, quantile beta subtracted),
// group-limited routing's mask, Sinkhorn (S-BASE) balancing of the training key, the top-K of
// a top-(K+1), and capacity dropping. The top-k itself is ops/softmax_topk.h's. Ties go to the
// lower index everywhere and the sums run in a fixed order, so every result is deterministic
// and bitwise the same for any thread count.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void routing_key(double* key_TE, const double* src_TE, const float* offset_E, bool subtract,
                 int64_t n_tok, int64_t E);
void group_limited_mask(double* key_TE, double* scratch_TE, int64_t n_tok, int64_t E,
                        int64_t num_groups, int64_t group_topk, int64_t K);
void sinkhorn_balance(double* cost_TE, double* d0_T, double* d1_2E, const double* logits_TE,
                      int64_t n_tok, int64_t E);
void topk_prefix(int32_t* idx_TK, const int32_t* idx_TK1, int64_t n_tok, int64_t K, int64_t K1);
void apply_capacity(int32_t* idx_TK, double* probs_TK, int64_t* dropped, int32_t* cand_N,
                    int64_t* cand_off_2E1, const int32_t* routed_TK, int64_t n_tok, int64_t K,
                    int64_t E, int64_t capacity, bool by_probs);
}  // namespace cpu
// The CUDA kernels (ops/cuda/router_select.cu); `stream` is the context's. The switches below call
// them where the build has kernels. Every result is bitwise the CPU fast path's, but for
// Sinkhorn's cost where the device's exp rounds otherwise than the host's; Sinkhorn not
// converging leaves cost NaN instead of throwing (the device cannot).
namespace cuda {
void routing_key(void* stream, double* key_TE, const double* src_TE, const float* offset_E,
                 bool subtract, int64_t n_tok, int64_t E);
void group_limited_mask(void* stream, double* key_TE, double* scratch_TE, int64_t n_tok, int64_t E,
                        int64_t num_groups, int64_t group_topk, int64_t K);
void sinkhorn_balance(void* stream, double* cost_TE, double* d0_T, double* d1_2E,
                      const double* logits_TE, int64_t n_tok, int64_t E);
void topk_prefix(void* stream, int32_t* idx_TK, const int32_t* idx_TK1, int64_t n_tok, int64_t K,
                 int64_t K1);
void apply_capacity(void* stream, int32_t* idx_TK, double* probs_TK, int64_t* dropped,
                    int32_t* cand_N, int64_t* cand_off_2E1, const int32_t* routed_TK,
                    int64_t n_tok, int64_t K, int64_t E, int64_t capacity, bool by_probs);
}  // namespace cuda

// key[t, e] = src[t, e] + offset[e] (subtract: - offset[e]); offset null: a copy. The expert
// bias (added) and the quantile beta (subtracted) touch only the key, never the probs.
inline void routing_key(const Exec& ex, DevPtr<double> key_TE, DevPtr<const double> src_TE,
                        DevPtr<const float> offset_E, bool subtract, int64_t n_tok, int64_t E) {
  if (ex.on_cpu())
    return cpu::routing_key(raw_ptr(key_TE), raw_ptr(src_TE), raw_ptr(offset_E), subtract, n_tok,
                            E);
  return cuda::routing_key(ex.stream, raw_ptr(key_TE), raw_ptr(src_TE), raw_ptr(offset_E),
                           subtract, n_tok, E);
}
void routing_key_ref(double* key_TE, const double* src_TE, const float* offset_E, bool subtract,
                     int64_t n_tok, int64_t E);

// Megatron's group_limited_topk, in place on the key: E experts in num_groups contiguous groups;
// a group's score is the sum of its top-(K / group_topk) keys (largest first); the group_topk
// best groups stay (ties to the lower group), every other expert's key becomes -inf.
// scratch [T, E] is overwritten. num_groups <= 256.
inline void group_limited_mask(const Exec& ex, DevPtr<double> key_TE, DevPtr<double> scratch_TE,
                               int64_t n_tok, int64_t E, int64_t num_groups, int64_t group_topk,
                               int64_t K) {
  if (ex.on_cpu())
    return cpu::group_limited_mask(raw_ptr(key_TE), raw_ptr(scratch_TE), n_tok, E, num_groups,
                                   group_topk, K);
  return cuda::group_limited_mask(ex.stream, raw_ptr(key_TE), raw_ptr(scratch_TE), n_tok, E,
                                  num_groups, group_topk, K);
}
void group_limited_mask_ref(double* key_TE, int64_t n_tok, int64_t E, int64_t num_groups,
                            int64_t group_topk, int64_t K);

// Megatron's sinkhorn(): cost = exp(logits) scaled into a doubly stochastic matrix by row
// factors d0 [T] and column factors d1 (d1_2E: [E] factors, [E] the previous iteration's),
// iterated until the mean |change of d1| <= 1e-4 (eps 1e-8 guards the divisions). Throws when
// it does not converge in 100000 iterations.
inline void sinkhorn_balance(const Exec& ex, DevPtr<double> cost_TE, DevPtr<double> d0_T,
                             DevPtr<double> d1_2E, DevPtr<const double> logits_TE, int64_t n_tok,
                             int64_t E) {
  if (ex.on_cpu())
    return cpu::sinkhorn_balance(raw_ptr(cost_TE), raw_ptr(d0_T), raw_ptr(d1_2E),
                                 raw_ptr(logits_TE), n_tok, E);
  return cuda::sinkhorn_balance(ex.stream, raw_ptr(cost_TE), raw_ptr(d0_T), raw_ptr(d1_2E),
                                raw_ptr(logits_TE), n_tok, E);
}
void sinkhorn_balance_ref(double* cost_TE, double* d0_T, double* d1_2E, const double* logits_TE,
                          int64_t n_tok, int64_t E);

// idx [T, K] = the first K columns of idx [T, K1] (quantile balancing selects K of a top-(K+1)
// whose last column is the threshold).
inline void topk_prefix(const Exec& ex, DevPtr<int32_t> idx_TK, DevPtr<const int32_t> idx_TK1,
                        int64_t n_tok, int64_t K, int64_t K1) {
  if (ex.on_cpu()) return cpu::topk_prefix(raw_ptr(idx_TK), raw_ptr(idx_TK1), n_tok, K, K1);
  return cuda::topk_prefix(ex.stream, raw_ptr(idx_TK), raw_ptr(idx_TK1), n_tok, K, K1);
}
void topk_prefix_ref(int32_t* idx_TK, const int32_t* idx_TK1, int64_t n_tok, int64_t K, int64_t K1);

// Capacity: idx = routed, then each expert keeps at most `capacity` of its (token, slot) pairs,
// the largest probs (by_probs; ties to the lower (t, k)) or the first in token order; a dropped
// pair gets idx -1 and prob 0, and *dropped counts them. capacity 0: dropless (idx = routed,
// nothing dropped). cand_N [T * K] and cand_off_2E1 [2 E + 1] are scratch.
inline void apply_capacity(const Exec& ex, DevPtr<int32_t> idx_TK, DevPtr<double> probs_TK,
                           DevPtr<int64_t> dropped, DevPtr<int32_t> cand_N,
                           DevPtr<int64_t> cand_off_2E1, DevPtr<const int32_t> routed_TK,
                           int64_t n_tok, int64_t K, int64_t E, int64_t capacity, bool by_probs) {
  if (ex.on_cpu())
    return cpu::apply_capacity(raw_ptr(idx_TK), raw_ptr(probs_TK), raw_ptr(dropped),
                               raw_ptr(cand_N), raw_ptr(cand_off_2E1), raw_ptr(routed_TK), n_tok, K,
                               E, capacity, by_probs);
  return cuda::apply_capacity(ex.stream, raw_ptr(idx_TK), raw_ptr(probs_TK), raw_ptr(dropped),
                              raw_ptr(cand_N), raw_ptr(cand_off_2E1), raw_ptr(routed_TK), n_tok,
                              K, E, capacity, by_probs);
}
void apply_capacity_ref(int32_t* idx_TK, double* probs_TK, int64_t* dropped,
                        const int32_t* routed_TK, int64_t n_tok, int64_t K, int64_t E,
                        int64_t capacity, bool by_probs);

}  // namespace moecore::ops
