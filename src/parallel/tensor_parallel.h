// Tensor and sequence parallelism as the layers see them (Megatron-Core's tensor-parallel
// mappings): one TP group, and whether the activations between TP regions are split over the
// sequence. A TP region is a column-parallel projection (its output features split over TP:
// QKV, fc1) followed by a row-parallel one (its input features split: the attention output
// projection, fc2), whose output is a partial sum on every TP rank:
//
//   without SP: x [n, H] (whole, equal on every TP rank) -> enter: x itself
//               -> column / local work / row -> partial [n, H] -> leave: all-reduce
//   with SP:    x [n/tp, H] (this rank's tokens) -> enter: all-gather over TP -> [n, H]
//               -> column / local work / row -> partial [n, H] -> leave: reduce-scatter
//
// and the backward in reverse (enter's backward: all-reduce or reduce-scatter of the input
// gradient, leave's: nothing or an all-gather). Tokens are sequence-major (t = s * B + b), so a
// rank's sequence slice s in [r S/tp, (r+1) S/tp) is the contiguous token range
// [r n/tp, (r+1) n/tp): the all-gather and reduce-scatter are plain concatenations in rank order.
// With one rank every function is a no-op (or a copy where the output is another buffer), so one
// layer code serves every layout.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"
#include "nn/param_registry.h"

namespace moecore::parallel {

class ProcessGroup;
class ProcessGroups;

class TensorParallel {
 public:
  TensorParallel() = default;  // one rank
  TensorParallel(const ProcessGroup* group, bool sequence_parallel);
  // The attention grid's TP group and --sequence-parallel (null groups: one rank).
  static TensorParallel attention(const ProcessGroups* groups);
  // Expert tensor parallelism's group (expt_tp); the experts' tokens are never sequence-split.
  static TensorParallel expert(const ProcessGroups* groups);

  // The same group with the activations between TP regions sequence-split (the MoE layer's
  // view: its tokens are this rank's sequence slice whether or not the model runs with SP).
  TensorParallel with_sequence_parallel() const {
    TensorParallel t = *this;
    t.sp_ = true;
    return t;
  }
  TpShard shard() const { return TpShard{rank_, size_}; }
  // The role of a replicated parameter applied to the tokens a rank holds between TP regions
  // (norms, learned positions): partial gradients under sequence parallelism only.
  TpRole token_role() const {
    return sequence_parallel() ? TpRole::ReplicatedPartialGrad : TpRole::Replicated;
  }

  int size() const { return size_; }
  int rank() const { return rank_; }
  bool active() const { return size_ > 1; }
  // Activations between TP regions hold n / tp tokens (only with more than one TP rank).
  bool sequence_parallel() const { return sp_ && size_ > 1; }
  // The tokens this rank holds between TP regions, of a micro-batch's n, and the first of them.
  int64_t local_tokens(int64_t n) const { return sequence_parallel() ? n / size_ : n; }
  int64_t first_token(int64_t n) const { return sequence_parallel() ? rank_ * (n / size_) : 0; }
  // This rank's equal share [rank * count / tp, +count / tp) of `count` (heads, query groups,
  // features, vocabulary rows); the caller has checked that tp divides count.
  int64_t share(int64_t count) const { return count / size_; }
  int64_t share_offset(int64_t count) const { return rank_ * (count / size_); }

  // Entering a TP region with x [local_tokens(n), H]: the whole [n, H] input of the
  // column-parallel projection. With SP it is all-gathered into full_nH and returned; without,
  // x itself is returned (full_nH unused, may be null).
  template <typename T>
  DevPtr<const T> enter(const Exec& ex, DevPtr<const T> x, DevPtr<T> full_nH, int64_t n,
                        int64_t H) const;
  // The same in bf16 bytes (--bf16, Megatron-Core's bf16 activations): with SP and a staging
  // buffer wire16 of enter_wire_elems(n, H) elements, x is cast to bf16 into it, all-gathered as
  // bf16 and widened into full_nH: half the bytes of the f32 all-gather. Exact only for values
  // whose every reader takes their bf16 values: x's producer rounded it, or what the region
  // does with the gathered input is bf16 GEMMs, which round their input to nearest even as the
  // cast does. Then every reader sees the bits the f32 all-gather gave it. A null wire16 (or T
  // other than float) is the f32 all-gather.
  template <typename T>
  DevPtr<const T> enter(const Exec& ex, DevPtr<const T> x, DevPtr<T> full_nH, int64_t n, int64_t H,
                        DevPtr<bf16> wire16) const;
  // The bf16 staging enter needs: this rank's piece and the gathered whole (0 without SP: enter
  // moves nothing then).
  int64_t enter_wire_elems(int64_t n, int64_t H) const {
    return sequence_parallel() ? (local_tokens(n) + n) * H : 0;
  }
  // Its backward: the input gradient dfull_nH [n, H] (this rank's partial sum) to the gradient
  // of x: reduce-scattered into dx [local_tokens(n), H] with SP, all-reduced without (dx may be
  // dfull_nH then; otherwise it is copied).
  template <typename T>
  void enter_backward(const Exec& ex, DevPtr<T> dfull_nH, DevPtr<T> dx, int64_t n, int64_t H) const;
  // Leaving a TP region: the row-parallel projection's partial [n, H] to y [local_tokens(n), H]:
  // reduce-scattered with SP, all-reduced without (y may be partial_nH then; otherwise copied).
  template <typename T>
  void leave(const Exec& ex, DevPtr<T> partial_nH, DevPtr<T> y, int64_t n, int64_t H) const {
    enter_backward(ex, partial_nH, y, n, H);
  }
  // Its backward: dy [local_tokens(n), H] to the whole [n, H] gradient of the row-parallel
  // output (all-gathered with SP; dy itself without). With a staging buffer wire16 of
  // enter_wire_elems(n, H) the gather moves bf16 bytes (enter's form): exact only when every
  // reader of the gathered gradient takes its bf16 values (the row-parallel projection's bf16
  // GEMMs; not a bias gradient, which sums its f32 values). The choice must be the same on every
  // rank of the group.
  template <typename T>
  DevPtr<const T> leave_backward(const Exec& ex, DevPtr<const T> dy, DevPtr<T> full_nH, int64_t n,
                                 int64_t H, DevPtr<bf16> wire16 = nullptr) const {
    return enter(ex, dy, full_nH, n, H, wire16);
  }

  // The plain collectives over the group, ordered on ex's stream (no-ops on one rank).
  template <typename T>
  void all_reduce(const Exec& ex, DevPtr<T> data, int64_t count) const;
  template <typename T>
  void all_reduce_max(const Exec& ex, DevPtr<T> data, int64_t count) const;
  // full = concat over ranks of local (count elements each).
  template <typename T>
  void all_gather(const Exec& ex, DevPtr<const T> local, DevPtr<T> full, int64_t count) const;
  // data (count elements) = the group's rank `root`'s.
  template <typename T>
  void broadcast(const Exec& ex, DevPtr<T> data, int64_t count, int root) const;
  // local (count elements) = sum over ranks of full's piece of this rank.
  template <typename T>
  void reduce_scatter(const Exec& ex, DevPtr<const T> full, DevPtr<T> local, int64_t count) const;

  const ProcessGroup* group() const { return group_; }

 private:
  const ProcessGroup* group_ = nullptr;
  int size_ = 1;
  int rank_ = 0;
  bool sp_ = false;
};

}  // namespace moecore::parallel
