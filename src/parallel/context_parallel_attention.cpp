// ContextParallelAttention: the AllGather and P2P (ring) forms of the attention core over the cp
// group, built from ops::attention's block form and the log-sum-exp merge. Why the backward of
// each block needs no merge: given the final (merged) out and lse, a block's share of dq, dk,
// dv is exact on its own (FlashAttention-2's P = exp(s - lse), delta = rowsum(dO o O)), so the
// shares only add.
#include "parallel/context_parallel_attention.h"

#include <omp.h>

#include <algorithm>

#include "core/check.h"
#include "core/dtype.h"
#include "ops/add.h"
#include "ops/attention_merge.h"
#include "ops/memory.h"
#include "ops/token_layout.h"

namespace moecore::parallel {

namespace {
// Tags of the ring's messages: K / V and dK / dV between the same two ranks stay apart.
constexpr int kTagKv = 431;
constexpr int kTagDkv = 432;
}  // namespace

template <typename T>
void ContextParallelAttention<T>::allocate(Arena& arena, const ops::AttentionShape& local,
                                           std::string_view name) {
  const std::string p(name);
  ex_ = &arena.exec();
  ops::check_attention_shape(local, "cp_attention");
  MOE_CHECK(!local.is_block() && local.lse_stride == 0,
            "[cp_attention] the local shape must be the plain one (S = 2 C rows, Sk, offsets and "
            "lse_stride 0): the blocks are planned here");
  local_ = local;
  const int cp = cp_.size();
  check_context_split(cp_.split(local.S * cp));
  C_ = local.S / 2;
  rq_ = local.B * local.Hq * local.D;
  rk_ = local.B * local.Hkv * local.D;
  const int n_threads = omp_get_max_threads();
  if (!cp_.active()) {
    workspace_ = arena.alloc<T>(ops::attention_workspace_elems(local, n_threads), p + ".workspace",
                                MemKind::Workspace);
    return;
  }
  const int64_t S = local.S * cp, local_elems = local.S * rk_;
  positions_ = arena.alloc<int32_t>(S * local.B, p + ".positions", MemKind::Workspace);
  if (cp_.type() == CpCommType::AllGather) {
    // The largest block: the later chunk (2 cp - 1 - r) against its whole prefix.
    workspace_ = arena.alloc<T>(
        ops::attention_workspace_elems(block(1, 0, (2 * cp - cp_.rank()) * C_), n_threads),
        p + ".workspace", MemKind::Workspace);
    gathered_ = arena.alloc<T>(cp * local_elems, p + ".gathered", MemKind::Workspace);
    k_glob_ = arena.alloc<T>(S * rk_, p + ".k_global", MemKind::Workspace);
    v_glob_ = arena.alloc<T>(S * rk_, p + ".v_global", MemKind::Workspace);
    dk_blk_ = arena.alloc<T>(S * rk_, p + ".dk_block", MemKind::Workspace);
    dv_blk_ = arena.alloc<T>(S * rk_, p + ".dv_block", MemKind::Workspace);
    return;
  }
  workspace_ = arena.alloc<T>(ops::attention_workspace_elems(block(1, 0, C_), n_threads),
                              p + ".workspace", MemKind::Workspace);
  for (int i = 0; i < 2; ++i) {
    kv_[i] = arena.alloc<T>(2 * local_elems, p + ".kv_ring", MemKind::Workspace);
    dkv_[i] = arena.alloc<T>(2 * local_elems, p + ".dkv_ring", MemKind::Workspace);
  }
  out_blk_ = arena.alloc<T>(local.S * rq_, p + ".out_block", MemKind::Workspace);
  lse_blk_ = arena.alloc<T>(local.B * local.Hq * local.S, p + ".lse_block", MemKind::Workspace);
  dq_blk_ = arena.alloc<T>(C_ * rq_, p + ".dq_block", MemKind::Workspace);
  dk_blk_ = arena.alloc<T>(2 * C_ * rk_, p + ".dkv_block", MemKind::Workspace);
  dv_blk_ = dk_blk_ == nullptr ? nullptr : dk_blk_ + C_ * rk_;
}

template <typename T>
void ContextParallelAttention<T>::positions(DevPtr<int32_t> pos_T) {
  global_positions(*ex_, cp_, pos_T, positions_, local_.S, local_.B);
}

template <typename T>
ops::AttentionShape ContextParallelAttention<T>::block(int hq, int64_t k_chunk,
                                                       int64_t n_keys) const {
  ops::AttentionShape s = local_;
  s.S = C_;
  s.Sk = n_keys;
  s.q_offset = cp_.split(local_.S * cp_.size()).chunk_index(hq) * C_;
  s.k_offset = k_chunk * C_;
  s.lse_stride = local_.S;
  return s;
}

template <typename T>
void ContextParallelAttention<T>::forward(DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q,
                                          DevPtr<const T> k, DevPtr<const T> v,
                                          const ops::AttentionDropout* drop) {
  MOE_CHECK(workspace_ != nullptr || local_.S * local_.B == 0,
            "[cp_attention] forward before allocate(): allocate it from the arena first");
  if (!cp_.active())
    return ops::attention_forward(*ex_, out, lse, q, k, v, local_, workspace_, drop);
  if (cp_.type() == CpCommType::AllGather) return forward_all_gather(out, lse, q, k, v, drop);
  forward_p2p(out, lse, q, k, v, drop);
}

template <typename T>
void ContextParallelAttention<T>::backward(DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv,
                                           DevPtr<const T> dout, DevPtr<const T> q,
                                           DevPtr<const T> k, DevPtr<const T> v,
                                           DevPtr<const T> out, DevPtr<const T> lse,
                                           const ops::AttentionDropout* drop) {
  if (!cp_.active())
    return ops::attention_backward(*ex_, dq, dk, dv, dout, q, k, v, out, lse, local_, workspace_,
                                   drop);
  if (cp_.type() == CpCommType::AllGather)
    return backward_all_gather(dq, dk, dv, dout, q, k, v, out, lse, drop);
  backward_p2p(dq, dk, dv, dout, q, k, v, out, lse, drop);
}

// ---- AllGather ----

template <typename T>
void ContextParallelAttention<T>::gather_global(DevPtr<T> x_glob, DevPtr<const T> x) {
  const int cp = cp_.size();
  const int64_t local_elems = local_.S * rk_;
  cp_.communicator().all_gather_async(x, gathered_, local_elems, DTypeOf<T>::value).wait_on(*ex_);
  // Rank q's rows [chunk q ; chunk 2 cp - 1 - q] to their global chunks.
  for (int r = 0; r < cp; ++r) {
    ops::copy<T>(*ex_, x_glob + r * C_ * rk_, gathered_ + r * local_elems, C_ * rk_);
    ops::copy<T>(*ex_, x_glob + (2 * cp - 1 - r) * C_ * rk_, gathered_ + r * local_elems + C_ * rk_,
                 C_ * rk_);
  }
}

template <typename T>
void ContextParallelAttention<T>::scatter_global(DevPtr<T> out, DevPtr<T> x_glob) {
  const int cp = cp_.size();
  const int64_t local_elems = local_.S * rk_;
  for (int r = 0; r < cp; ++r) {
    ops::copy<T>(*ex_, gathered_ + r * local_elems, x_glob + r * C_ * rk_, C_ * rk_);
    ops::copy<T>(*ex_, gathered_ + r * local_elems + C_ * rk_, x_glob + (2 * cp - 1 - r) * C_ * rk_,
                 C_ * rk_);
  }
  cp_.communicator()
      .reduce_scatter_async(gathered_, out, local_elems, DTypeOf<T>::value, ReduceOp::Sum)
      .wait_on(*ex_);
}

template <typename T>
void ContextParallelAttention<T>::forward_all_gather(DevPtr<T> out, DevPtr<T> lse,
                                                     DevPtr<const T> q, DevPtr<const T> k,
                                                     DevPtr<const T> v,
                                                     const ops::AttentionDropout* drop) {
  gather_global(k_glob_, k);
  gather_global(v_glob_, v);
  for (int hq = 0; hq < 2; ++hq) {  // each local chunk against the keys [0, its end)
    const ops::AttentionShape s = block(hq, 0, 0);
    const ops::AttentionShape b = block(hq, 0, s.q_offset + C_);
    ops::attention_forward(*ex_, out + hq * C_ * rq_, lse + hq * C_, q + hq * C_ * rq_,
                           DevPtr<const T>(k_glob_), DevPtr<const T>(v_glob_), b, workspace_, drop);
  }
}

template <typename T>
void ContextParallelAttention<T>::backward_all_gather(DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv,
                                                      DevPtr<const T> dout, DevPtr<const T> q,
                                                      DevPtr<const T> k, DevPtr<const T> v,
                                                      DevPtr<const T> out, DevPtr<const T> lse,
                                                      const ops::AttentionDropout* drop) {
  const int64_t S = local_.S * cp_.size();
  gather_global(k_glob_, k);
  gather_global(v_glob_, v);
  // The later chunk's keys [0, n1) cover the earlier one's: its dK / dV go straight into the
  // partial sums (the rows past n1 zero), the earlier chunk's are added.
  const ops::AttentionShape b1 = block(1, 0, block(1, 0, 0).q_offset + C_);
  const ops::AttentionShape b0 = block(0, 0, block(0, 0, 0).q_offset + C_);
  // k_glob_ / v_glob_ are read by both blocks: the partial sums go to the dK / dV block buffers
  // for chunk 1, chunk 0's to the gathered buffer's space (S rows fit: cp * 2C == S).
  ops::attention_backward(*ex_, dq + C_ * rq_, dk_blk_, dv_blk_, dout + C_ * rq_, q + C_ * rq_,
                          DevPtr<const T>(k_glob_), DevPtr<const T>(v_glob_), out + C_ * rq_,
                          lse + C_, b1, workspace_, drop);
  ops::zero<T>(*ex_, dk_blk_ + b1.keys() * rk_, (S - b1.keys()) * rk_);
  ops::zero<T>(*ex_, dv_blk_ + b1.keys() * rk_, (S - b1.keys()) * rk_);
  // Chunk 0's dK into k_glob_'s place once K is no longer read: dK0 -> gathered_, then add.
  const int64_t n0 = b0.keys() * rk_;
  ops::attention_backward(*ex_, dq, gathered_, gathered_ + n0, dout, q, DevPtr<const T>(k_glob_),
                          DevPtr<const T>(v_glob_), out, lse, b0, workspace_, drop);
  ops::add<T>(*ex_, dk_blk_, dk_blk_, gathered_, n0);
  ops::add<T>(*ex_, dv_blk_, dv_blk_, gathered_ + n0, n0);
  scatter_global(dk, dk_blk_);
  scatter_global(dv, dv_blk_);
}

// ---- P2P (ring) ----
// At step t rank r holds the K / V of rank src = r - t (mod cp): key chunks src and
// 2 cp - 1 - src. With query chunks r and 2 cp - 1 - r: step 0 is the two diagonals and the
// later chunk against the earlier one; a step with src < r is both query chunks against key
// chunk src; one with src > r the later query chunk against both key chunks. Every rank does the
// same number of blocks per step (Megatron's load balance).

template <typename T>
int64_t ContextParallelAttention<T>::ring_start(DevPtr<const T> k, DevPtr<const T> v) {
  const int64_t local_elems = local_.S * rk_;
  ops::copy<T>(*ex_, kv_[0], k, local_elems);
  ops::copy<T>(*ex_, kv_[0] + local_elems, v, local_elems);
  return local_elems;
}

template <typename T>
void ContextParallelAttention<T>::ring_post(int cur, int64_t local_elems, CommHandle& send,
                                            CommHandle& recv) {
  const int cp = cp_.size(), r = cp_.rank();
  Communicator& comm = cp_.communicator();
  const DType dt = DTypeOf<T>::value;
  send.wait_on(*ex_);  // the buffer received into next has left
  send = comm.send_async(kv_[cur], 2 * local_elems, dt, (r + 1) % cp, kTagKv);
  recv = comm.recv_async(kv_[1 - cur], 2 * local_elems, dt, (r + cp - 1) % cp, kTagKv);
}

template <typename T>
template <typename F>
void ContextParallelAttention<T>::for_each_ring_block(int t, F&& f) const {
  const int cp = cp_.size(), src = (cp_.rank() - t + cp) % cp;
  for (int hq = 0; hq < 2; ++hq) {
    const int64_t qc = block(hq, 0, 0).q_offset / C_;
    for (int hk = 0; hk < 2; ++hk) {
      const int64_t kc = hk == 0 ? src : 2 * cp - 1 - src;
      if (kc > qc) continue;     // the keys follow every query: fully masked
      f(hq, hk, block(hq, kc, C_));  // kc == qc: the causal diagonal
    }
  }
}

template <typename T>
void ContextParallelAttention<T>::forward_p2p(DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q,
                                              DevPtr<const T> k, DevPtr<const T> v,
                                              const ops::AttentionDropout* drop) {
  const int cp = cp_.size();
  const int64_t local_elems = ring_start(k, v);
  CommHandle send, recv;
  bool written[2] = {false, false};
  for (int t = 0; t < cp; ++t) {
    const int cur = t % 2;
    if (t > 0) recv.wait_on(*ex_);  // this step's K / V arrived
    if (t + 1 < cp) ring_post(cur, local_elems, send, recv);  // before this step's blocks
    for_each_ring_block(t, [&](int hq, int hk, const ops::AttentionShape& b) {
      DevPtr<const T> kb = kv_[cur] + hk * C_ * rk_, vb = kv_[cur] + local_elems + hk * C_ * rk_;
      if (!written[hq]) {
        ops::attention_forward(*ex_, out + hq * C_ * rq_, lse + hq * C_, q + hq * C_ * rq_, kb, vb,
                               b, workspace_, drop);
        written[hq] = true;
        return;
      }
      ops::attention_forward(*ex_, out_blk_ + hq * C_ * rq_, lse_blk_ + hq * C_,
                             q + hq * C_ * rq_, kb, vb, b, workspace_, drop);
      ops::attention_merge(*ex_, out + hq * C_ * rq_, lse + hq * C_,
                           DevPtr<const T>(out_blk_ + hq * C_ * rq_),
                           DevPtr<const T>(lse_blk_ + hq * C_), b);
    });
  }
  send.wait_on(*ex_);
}

template <typename T>
void ContextParallelAttention<T>::backward_p2p(DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv,
                                               DevPtr<const T> dout, DevPtr<const T> q,
                                               DevPtr<const T> k, DevPtr<const T> v,
                                               DevPtr<const T> out, DevPtr<const T> lse,
                                               const ops::AttentionDropout* drop) {
  const int cp = cp_.size(), r = cp_.rank();
  const int next = (r + 1) % cp, prev = (r + cp - 1) % cp;
  const int64_t local_elems = ring_start(k, v);
  const DType dt = DTypeOf<T>::value;
  Communicator& comm = cp_.communicator();
  ops::zero<T>(*ex_, dkv_[0], 2 * local_elems);
  ops::zero<T>(*ex_, dq, local_.S * rq_);
  CommHandle send, recv, dsend, drecv;
  for (int t = 0; t < cp; ++t) {
    const int cur = t % 2;
    if (t > 0) {
      recv.wait_on(*ex_);   // this step's K / V
      drecv.wait_on(*ex_);  // and their dK / dV summed by the ranks before
    }
    if (t + 1 < cp) ring_post(cur, local_elems, send, recv);
    for_each_ring_block(t, [&](int hq, int hk, const ops::AttentionShape& b) {
      const int64_t ko = hk * C_ * rk_;
      ops::attention_backward(*ex_, dq_blk_, dk_blk_, dv_blk_, dout + hq * C_ * rq_,
                              q + hq * C_ * rq_, DevPtr<const T>(kv_[cur] + ko),
                              DevPtr<const T>(kv_[cur] + local_elems + ko), out + hq * C_ * rq_,
                              lse + hq * C_, b, workspace_, drop);
      ops::add<T>(*ex_, dq + hq * C_ * rq_, dq + hq * C_ * rq_, dq_blk_, C_ * rq_);
      ops::add<T>(*ex_, dkv_[cur] + ko, dkv_[cur] + ko, dk_blk_, C_ * rk_);
      ops::add<T>(*ex_, dkv_[cur] + local_elems + ko, dkv_[cur] + local_elems + ko, dv_blk_,
                  C_ * rk_);
    });
    // dK / dV on to the next rank; after the last step's hop they are back with their owner.
    dsend.wait_on(*ex_);
    dsend = comm.send_async(dkv_[cur], 2 * local_elems, dt, next, kTagDkv);
    drecv = comm.recv_async(dkv_[1 - cur], 2 * local_elems, dt, prev, kTagDkv);
  }
  drecv.wait_on(*ex_);
  ops::copy<T>(*ex_, dk, dkv_[cp % 2], local_elems);
  ops::copy<T>(*ex_, dv, dkv_[cp % 2] + local_elems, local_elems);
  send.wait_on(*ex_);
  dsend.wait_on(*ex_);
}

template class ContextParallelAttention<float>;
template class ContextParallelAttention<double>;

}  // namespace moecore::parallel
