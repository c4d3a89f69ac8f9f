// AdamW over the parameters of one registry: fp32 moment buffers planned in an arena, weight
// decay only on parameters that take it (not norms or biases), one global gradient norm over
// dense and expert parameters and one clipping coefficient (Megatron's clip_grad_norm).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "ops/adamw.h"
#include "ops/sum_squares.h"

namespace moecore::optim {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double clip_grad = 1.0;  // 0: no clipping
  void validate() const;
};

struct StepInfo {
  double grad_norm = 0;   // before clipping
  double clip_coeff = 1;  // applied to the gradients
  bool skipped = false;   // the update left every weight and moment as it was (a guard's veto)
};

// *out = the sum of squares of the gradients of one kind, accumulated in f64 (an op: `out` is
// planned memory of the registry's execution context).
void grad_sum_squares(const ParamRegistry& params, ParamKind kind, DevPtr<double> out);
// L2 norm of all gradients of `params` (dense and expert), accumulated in f64; for checks on
// the host (the optimizer keeps its norm in its step buffers).
double global_grad_norm(const ParamRegistry& params);

// An optimizer step's scalars in planned memory (the arena's memory space: on the device with a
// device backend), so that a step reads its inputs and leaves its results without a host round
// trip: the host writes step->lr and step->step before the step; the ops write the gradient
// sums of squares per kind, the norm, and step->grad_scale / step->skip (ops::grad_clip). The
// host reads them once, after the update (read_step_info).
struct OptimizerStepBuffers {
  DevPtr<ops::AdamWStep> step = nullptr;
  DevPtr<double> sum_sq = nullptr;  // [2]: dense, expert (the expert one summed over EP)
  DevPtr<double> norm = nullptr;    // [1]: before clipping
  void layout(Arena& a);
  // The step's inputs (lr, 1-based step), copied into `step` by an op on the stream: the host
  // values stay here until the copy has run.
  void write_inputs(const Exec& ex, double lr, int64_t step);

 private:
  double lr_host_ = 0;
  int64_t step_host_ = 0;
};
// The results of a finished step, read back to the host (after the step: a host read). Throws
// when its gradient norm was not finite: the update skipped every weight and moment
// (ops::adamw_step), so nothing is lost. max_norm (--clip-grad) only shapes the advice.
StepInfo read_step_info(const Exec& ex, const OptimizerStepBuffers& b, double max_norm);

// The state an AdamW over `numel` elements of each kind (dense, expert) plans: m and v in fp32
// for each kind, then master_numel fp32 master weights (the distributed optimizer's under --bf16;
// 0: the registry holds them). The optimizer allocates this layout; `moecore plan` runs it in a
// sizing arena (Arena::size_only) with counts from a sized registry.
void adamw_state_layout(Arena& a, const int64_t numel[2], DevPtr<float> m[2], DevPtr<float> v[2],
                        int64_t master_numel, DevPtr<float>* master);

// The distributed optimizer (--use-distributed-optimizer, ZeRO-1) as one rank sees it: the
// elements of each kind's flat buffer it updates (its shard of every gradient bucket,
// parallel/bucket_shards.h), whose gradients, summed over the bucket's group, the reduce-scatter
// left in place in the kind's flat gradient buffer; the moments are allocated for these
// elements only, packed in the owned layout.
struct OwnedRange {
  int64_t begin = 0;  // in the kind's flat buffers (values, gradients)
  int64_t count = 0;
  int64_t owned = 0;  // in the kind's owned buffers (moments)
};
struct ShardedState {
  std::vector<OwnedRange> ranges[2];  // per kind (dense, expert), any order
  int64_t owned_numel[2] = {0, 0};
  // --bf16 with the registry holding no master values (ParamRegistry::holds_master): the fp32
  // master weights of the owned elements are the optimizer's, packed in the owned layout beside
  // the moments, initialized from `seed` as the registry would (param_init_f32); each update
  // writes the owned elements' bf16 values, which the gathers then move (Megatron's
  // distributed optimizer: 6 + 12/d bytes per parameter).
  uint64_t seed = 0;
  // After the updates: the owned pieces of the values gathered so every rank holds them all.
  std::function<void()> gather_params;
};

class AdamWOptimizer {
 public:
  // Over every parameter of the registry (dense and expert).
  AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg);
  // Over the parameters of one kind only (ChainedOptimizer holds one per kind).
  AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg, ParamKind only);
  // Over the owned elements of one kind only (the distributed optimizer): the norm's sum of
  // squares and the update cover those; a shard boundary may cut a parameter, whose weight decay
  // applies to each piece.
  AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg, ParamKind only,
                 const ShardedState& sharded);
  // Norm, clip coefficient and one AdamW update at learning rate lr, enqueued as ops that read
  // nothing back; the step counter advances. last_step() reads the results afterwards.
  void apply(double lr);
  StepInfo last_step() const { return read_step_info(step_arena_.exec(), buf_, cfg_.clip_grad); }
  // apply() then last_step() (tests, tools).
  StepInfo step(double lr) {
    apply(lr);
    return last_step();
  }
  // The pieces of step() for an optimizer that computes the norm over several: this
  // optimizer's sums of squared gradients into sum_sq[kind] for the kinds it covers, and the
  // update with the step's scalars (lr, step, clip coefficient, skip) read from `s`.
  void grad_sum_squares(DevPtr<double> sum_sq) const;
  // The norm's sum of squares covers only the parameters `counted` accepts (tensor parallelism:
  // a replicated parameter on one TP rank, parallel::GradBuckets::counted_once), of the
  // elements it covers otherwise (all, or the owned ones). When it accepts every parameter
  // nothing changes (the same sums, bitwise).
  void count_only(const std::function<bool(const Param&)>& counted);
  void update(DevPtr<const ops::AdamWStep> s);
  int64_t steps_taken() const { return step_; }
  // Resuming from a checkpoint: the steps already taken (bias correction continues from them).
  void set_steps_taken(int64_t n);
  bool sharded() const { return sharded_.has_value(); }
  // Parameter p's moments (fp32, p's local elements): what a checkpoint saves and loads. Not
  // with the distributed optimizer (this rank holds only pieces of them: pieces()).
  DevPtr<float> exp_avg(const Param& p) const;
  DevPtr<float> exp_avg_sq(const Param& p) const;
  // A piece of a parameter this rank updates under the distributed optimizer (a parameter lies
  // in one gradient bucket, so a rank holds at most one piece of it).
  struct Piece {
    Param* p = nullptr;
    int64_t begin = 0;  // in the kind's flat buffer
    int64_t count = 0;
    int64_t owned = 0;  // in the owned buffers
  };
  // The distributed optimizer's pieces, in parameter order, and the moments of its kind's
  // owned elements in the owned layout (ShardedState): what a checkpoint saves and loads, piece
  // by piece (train/checkpointing.cpp).
  const std::vector<Piece>& pieces() const { return pieces_; }
  DevPtr<float> owned_exp_avg() const;
  DevPtr<float> owned_exp_avg_sq() const;
  // The fp32 master weights of the owned elements (owned layout) when this optimizer holds them
  // (ShardedState; null otherwise: they are the registry's values).
  DevPtr<float> owned_master() const { return w_; }
  bool holds_master() const { return master_; }
  // The digest of the owned master weights (ParamRegistry::digest's terms for these elements):
  // summed over the group it is the digest of the whole values.
  // counted: the parameters to include (null: all).
  uint64_t owned_master_digest(const std::function<bool(const Param&)>& counted = {}) const;
  const Arena& arena() const { return arena_; }

 private:
  void plan();
  template <typename T>
  void update_typed(DevPtr<const ops::AdamWStep> s);
  bool covers(ParamKind k) const { return all_kinds_ || k == only_; }
  void plan_pieces();
  void init_master(uint64_t seed);

  ParamRegistry& params_;
  AdamWConfig cfg_;
  bool all_kinds_ = true;
  ParamKind only_ = ParamKind::Dense;
  Arena arena_;
  Arena step_arena_;  // step()'s buffers, apart from the moments (adamw_state_layout)
  OptimizerStepBuffers buf_;
  DevPtr<float> m_[2] = {nullptr, nullptr};
  DevPtr<float> v_[2] = {nullptr, nullptr};
  DevPtr<float> w_ = nullptr;  // the owned fp32 master weights (ShardedState, no registry master)
  bool master_ = false;        // whether this optimizer holds them (w_ is null with none owned)
  int64_t step_ = 0;
  std::optional<ShardedState> sharded_;
  std::vector<Piece> pieces_;  // in parameter order
  std::vector<ops::ElemRange> owned_flat_;  // the owned ranges in flat order (the norm's sum)
  // count_only's ranges of the counted elements per kind, in flat order (adjacent ones merged);
  // unset: every covered element counts.
  std::optional<std::vector<ops::ElemRange>> counted_[2];
};

}  // namespace moecore::optim
