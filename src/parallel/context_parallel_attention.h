// The attention core across context-parallel ranks: each CP rank holds 2 C of the sequence's S
// positions (parallel/context_split.h: chunks r and 2 cp - 1 - r, C = S / (2 cp)) and computes
// the causal attention of its queries over the whole sequence's keys, as Megatron-Core's
// --cp-comm-type:
// - AllGather: K and V all-gathered over the cp group and put in global order; each local query
//   chunk attends to the keys [0, its end) (ops::attention's block form); the backward
//   reduce-scatters dK / dV back to their owners.
// - P2P: a ring. K and V (both local chunks) pass from rank to rank + 1; at each of the cp steps
//   every (query chunk, key chunk) pair is full (the keys precede the queries), causal-diagonal
//   (the same chunk) or skipped (the keys follow), and the partial results are merged by
//   log-sum-exp (ops/attention_merge.h). The next step's exchange is posted before the current
//   step's blocks are computed. The backward passes K / V around the same way, with dK / dV
//   travelling beside them, back to their owners after cp hops.
// The same meaning as ops::attention_forward / backward on this rank's 2 C local rows: out and
// lse are the full causal softmax's, dropout bits are the one-rank model's (global positions).
// Legend: C chunk, S global sequence, B micro-batch, Hq / Hkv heads, D head dim.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/arena.h"
#include "ops/attention.h"
#include "parallel/communicator.h"
#include "parallel/context_parallel.h"

namespace moecore::parallel {

template <typename T>
class ContextParallelAttention {
 public:
  explicit ContextParallelAttention(ContextParallel cp = {}) : cp_(cp) {}

  // local: this rank's shape, S = 2 C local rows (the global length is cp * local.S; it must
  // divide by 2 cp), the other fields as ops::AttentionShape's defaults. Plans every buffer
  // (workspace kind) in the arena, named `name`.* (the layer's prefix: "attn", "mla"); nothing
  // allocates in forward / backward. One rank: the op's workspace alone, as the layers had it.
  void allocate(Arena& arena, const ops::AttentionShape& local, std::string_view name = "cp_attn");

  // q, out [2C, B, Hq, D]; k, v [2C, B, Hkv, D]; lse [B, Hq, 2C]: the local rows in local order.
  // drop: the layer's dropout (its head0 the rank's first head), null or p == 0 for none.
  void forward(DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q, DevPtr<const T> k,
               DevPtr<const T> v, const ops::AttentionDropout* drop);
  // dq, dk, dv assigned; out and lse from forward (or its recomputation); collective over cp.
  void backward(DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv, DevPtr<const T> dout, DevPtr<const T> q,
                DevPtr<const T> k, DevPtr<const T> v, DevPtr<const T> out, DevPtr<const T> lse,
                const ops::AttentionDropout* drop);

  // pos_T [2C * B]: the global sequence position of each local token t = s * B + b (s local),
  // for RoPE: split.global_position(s). After allocate(), with its arena allocated.
  void positions(DevPtr<int32_t> pos_T);

  const ContextParallel& cp() const { return cp_; }

 private:
  // The block of local query chunk hq (0, 1) against C keys of global chunk kc (P2P) or the
  // keys [0, end of its chunk) (AllGather); ops' block shape.
  ops::AttentionShape block(int hq, int64_t k_chunk, int64_t n_keys) const;
  // AllGather: gathers x [2C, rk] of every rank and writes it in global order [S, rk].
  void gather_global(DevPtr<T> x_glob, DevPtr<const T> x);
  // AllGather: reduce-scatters x_glob [S, rk] (a partial sum per rank, global order) to the
  // owners' local order: out [2C, rk].
  void scatter_global(DevPtr<T> out, DevPtr<T> x_glob);
  void forward_all_gather(DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q, DevPtr<const T> k,
                          DevPtr<const T> v, const ops::AttentionDropout* drop);
  void backward_all_gather(DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv, DevPtr<const T> dout,
                           DevPtr<const T> q, DevPtr<const T> k, DevPtr<const T> v,
                           DevPtr<const T> out, DevPtr<const T> lse,
                           const ops::AttentionDropout* drop);
  // P2P: posts the next ring step's K / V exchange (send kv_[cur] on, receive into the other)
  // once the previous send has left.
  void ring_post(int cur, int64_t local_elems, CommHandle& send, CommHandle& recv);
  // P2P: f(hq, hk, block shape) for each pair of local query chunk hq and ring step t's key
  // chunk hk that is not fully masked, in the order both passes use.
  template <typename F>
  void for_each_ring_block(int t, F&& f) const;
  // P2P: this rank's K and V copied into the ring's first buffer; returns the elements of each.
  int64_t ring_start(DevPtr<const T> k, DevPtr<const T> v);
  void forward_p2p(DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q, DevPtr<const T> k,
                   DevPtr<const T> v, const ops::AttentionDropout* drop);
  void backward_p2p(DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv, DevPtr<const T> dout,
                    DevPtr<const T> q, DevPtr<const T> k, DevPtr<const T> v, DevPtr<const T> out,
                    DevPtr<const T> lse, const ops::AttentionDropout* drop);

  ContextParallel cp_;
  const Exec* ex_ = &cpu_exec();
  ops::AttentionShape local_;            // S = 2 C
  int64_t C_ = 0, rq_ = 0, rk_ = 0;      // chunk rows; elements per row of q / out and of k / v
  DevPtr<T> workspace_ = nullptr;        // the attention op's, for the largest block
  DevPtr<int32_t> positions_ = nullptr;  // the whole sequence's positions [S * B] (positions())
  // AllGather: the gathered K or V in rank order [cp, 2C, rk], K and V in global order [S, rk]
  // (then dK and dV), one block's dK and dV [S, rk].
  DevPtr<T> gathered_ = nullptr, k_glob_ = nullptr, v_glob_ = nullptr;
  DevPtr<T> dk_blk_ = nullptr, dv_blk_ = nullptr;
  // P2P: K and V of the ring's current and next step [2][2 (K, V), 2C, rk]; their dK and dV
  // [2][2, 2C, rk]; one block's out [C, rq], lse [B, Hq, 2C] (at its chunk), dq [C, rq],
  // dk and dv [C, rk].
  DevPtr<T> kv_[2] = {nullptr, nullptr}, dkv_[2] = {nullptr, nullptr};
  DevPtr<T> out_blk_ = nullptr, lse_blk_ = nullptr, dq_blk_ = nullptr;
};

}  // namespace moecore::parallel
