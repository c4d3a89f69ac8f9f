// The vocab-parallel ends of the model over the attention grid's TP group (Megatron-Core's
// VocabParallelEmbedding, its column-parallel output layer and vocab_parallel_cross_entropy):
// each TP rank holds the rows [v0, v0 + Vp/tp) of the padded vocabulary Vp of the embedding table
// and of the output head (TpShard::slice(0, Vp)), and the whole [n, V] logits never exist on a
// rank.
// The padding is not part of the model (ModelConfig::padded_vocab_size): a rank's model rows are
// the first clamp(V - v0, 0, Vp/tp) of its slice (VocabShard), possibly none; the lookup, the
// head's GEMMs and the cross entropy run over those rows only, so the padded rows have no logit
// (Megatron's padded logits join the softmax) and never receive a gradient. A rank with no model
// rows contributes the reductions' identities (max -inf, sums 0) and a zero partial input
// gradient, and skips its GEMMs.
//   embedding: every rank looks up all n tokens in its slice (zeros for the other ranks' ids);
//     the partial [n, H] leaves the TP region (TensorParallel::leave: a reduce-scatter to this
//     rank's n/tp tokens with sequence parallelism, an all-reduce without).
//   head + cross entropy: over the whole [n, H] input (TensorParallel::enter's), chunks of
//     `chunk` tokens: the local logits [m, V/tp], per token the global max (one all-reduce max
//     per chunk), the global sum of exp and the target's logit (one all-reduce sum of both per
//     chunk), then the log-sum-exp and the loss, equal on every TP rank. The backward recomputes
//     each chunk's local logits, turns them into the local columns of softmax - onehot, and
//     gives this rank's partial input gradient (to TensorParallel::enter_backward) and the
//     weight gradient of its slice.
// With one TP rank the model uses the fused head (ops/cross_entropy.h) instead.
// --bf16 (f32 models): the head's GEMMs take bf16 values and accumulate in f32 as the fused
// head's do (ops::HeadLossBf16, both operand forms, over this rank's V/tp rows): h's bf16 form
// once per forward, the logits' gradient (softmax - onehot) * dloss computed in f32 and rounded
// to bf16 for the two backward GEMMs; the cross-entropy pieces stay f32 / f64. The embedding
// looks up the table's bf16 values (vocab_parallel_embedding_forward on the widened copy, or
// vocab_parallel_embedding_forward_bf16 on the bf16 copy).
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/cross_entropy.h"
#include "ops/vocab_parallel_ce.h"
#include "parallel/tensor_parallel.h"

namespace moecore::model {

// This rank's share of a vocabulary V padded to Vp: the table rows [v0, v0 + rows) it holds, of
// which the first `model` are the model's (the rest padding), and the cross entropy's slice of
// the model's columns.
struct VocabShard {
  int64_t v0 = 0, rows = 0, model = 0;
  ops::VocabSlice slice;  // {v0, model, V}
};
// Throws unless V <= Vp and tp divides Vp.
VocabShard vocab_shard(const parallel::TensorParallel& tp, int64_t V, int64_t Vp);

// A chunk's workspace: the local logits [rows, Vp/tp], the per-token maxima [rows] and the
// exp sums and target logits [2 rows], rows = min(chunk, n).
template <typename T>
struct VocabHeadWorkspace {
  DevPtr<T> logits = nullptr;
  DevPtr<T> max = nullptr;
  DevPtr<double> sums = nullptr;
};
inline int64_t vocab_head_chunk_rows(const ops::HeadLossShape& s) {
  return s.n_tok < s.chunk ? s.n_tok : s.chunk;
}

// y_local [tp.local_tokens(n), H] = the embedding rows of ids_n [n] (sequence-major, each in
// [0, V)), from this rank's slice w_local [Vp/tp, H] of the table of Vp rows. partial_nH [n, H]
// is workspace (may be y_local without sequence parallelism).
template <typename T>
void vocab_parallel_embedding_forward(const Exec& ex, const parallel::TensorParallel& tp,
                                      DevPtr<T> y_local, DevPtr<T> partial_nH,
                                      DevPtr<const int32_t> ids_n, DevPtr<const T> w_local,
                                      int64_t n, int64_t H, int64_t V, int64_t Vp);
// The same lookup from the bf16 values w16_local [Vp/tp, H] (the table's bf16 copy): its model
// rows widened (exactly) into w32_local [Vp/tp, H], then looked up as above; y_local holds the
// values ops::embedding_forward_bf16 gives on one rank.
void vocab_parallel_embedding_forward_bf16(const Exec& ex, const parallel::TensorParallel& tp,
                                           DevPtr<float> y_local, DevPtr<float> partial_nH,
                                           DevPtr<const int32_t> ids_n,
                                           DevPtr<const bf16> w16_local, DevPtr<float> w32_local,
                                           int64_t n, int64_t H, int64_t V, int64_t Vp);
// dw_local += the gradient of the slice's model rows from dy_local [tp.local_tokens(n), H] (the
// padding rows get none); full_nH [n, H] is workspace (the all-gathered gradient with sequence
// parallelism).
template <typename T>
void vocab_parallel_embedding_backward(const Exec& ex, const parallel::TensorParallel& tp,
                                       DevPtr<T> dw_local, DevPtr<const T> dy_local,
                                       DevPtr<T> full_nH, DevPtr<const int32_t> ids_n, int64_t n,
                                       int64_t H, int64_t V, int64_t Vp);

// The head + cross entropy of h_nH [n, H] (whole, equal on every TP rank) against w_local
// [Vp/tp, H]: loss_n, lse_n and *sum (+= the losses in token order) as ops::head_loss_forward's
// on the model's V rows, the same on every TP rank. s.V is the model's vocabulary, Vp the padded
// one the table is sliced from.
// bf16 (f32 only; w_local unused then): the fused head's operands for this rank's slice:
// w_VH (the slice's bf16 copy) with h16 [n, H], dz16 [vocab_head_chunk_rows(s), Vp/tp] and ws32
// of vocab_head_bf16_workspace_elems, or w_VH_wide (its widened copy) with h32 [n, H]. The
// forward writes h's bf16 form; the backward reads it as the forward left it.
template <typename T>
void vocab_parallel_head_loss_forward(const Exec& ex, const parallel::TensorParallel& tp,
                                      DevPtr<double> sum, DevPtr<T> loss_n, DevPtr<T> lse_n,
                                      DevPtr<const T> h_nH, DevPtr<const T> w_local,
                                      DevPtr<const int32_t> target_n, const ops::HeadLossShape& s,
                                      int64_t Vp, const VocabHeadWorkspace<T>& ws,
                                      const ops::HeadLossBf16* bf16 = nullptr);
// ws32 of the bf16-operand form at this rank's share Vp/tp of the vocabulary (0 on the native
// path).
int64_t vocab_head_bf16_workspace_elems(const Exec& ex, const parallel::TensorParallel& tp,
                                        const ops::HeadLossShape& s, int64_t Vp);
// Its backward: dh_nH (assigned) = this rank's partial input gradient (its vocabulary columns'
// share, zero on a rank of padding only; TensorParallel::enter_backward sums it), dw_local +=
// the slice's weight gradient (its model rows; the padding rows are not touched).
template <typename T>
void vocab_parallel_head_loss_backward(const Exec& ex, const parallel::TensorParallel& tp,
                                       DevPtr<T> dh_nH, DevPtr<T> dw_local, DevPtr<const T> h_nH,
                                       DevPtr<const T> w_local, DevPtr<const int32_t> target_n,
                                       DevPtr<const T> lse_n, DevPtr<const T> dloss,
                                       const ops::HeadLossShape& s, int64_t Vp,
                                       const VocabHeadWorkspace<T>& ws,
                                       const ops::HeadLossBf16* bf16 = nullptr);

}  // namespace moecore::model
