// The ChainedOptimizer of Megatron-Core: one AdamW for the dense parameters, one for the expert
// parameters, one global gradient norm over both counting every unique parameter once, and one
// clip coefficient applied to both (MOE_SEMANTICS "Gradients and the optimizer").
#pragma once

#include <functional>

#include "nn/param_registry.h"
#include "optim/optimizer.h"

namespace moecore::optim {

// How the norm's pieces combine across ranks; empty members = one rank. After the data-parallel
// reduction the dense gradients are identical on every dp rank, so each rank counts all of them.
// Each expert lives on exactly one EP rank: the expert sum of squares is summed over the EP
// group. Tensor parallelism: each rank counts its TP slices of the sharded parameters and, on
// TP rank 0 only, the replicated ones (`counted`); the dense sum is summed over tp, the expert
// sum over tp_ep (expt_tp x ep) instead of ep.
// With the distributed optimizer each rank sums the squares of its owned elements only: the
// dense part is summed over dp x cp and the expert part over expt_dp (then over ep), so that
// every element counts exactly once (not d times: Megatron's bugs #1628 and #5916).
struct GradNormSync {
  std::function<void(DevPtr<double> sum_sq)> sum_expert;  // in place, over ep (tp_ep with ETP)
  std::function<void(DevPtr<double> sum_sq)> sum_dense;   // in place, over tp
  // Which parameters this rank counts (null: all): AdamWOptimizer::count_only.
  std::function<bool(const Param&)> counted;
  std::function<void(DevPtr<double> sum_sq)> sum_dense_shards;   // in place, over dp x cp
  std::function<void(DevPtr<double> sum_sq)> sum_expert_shards;  // in place, over expt_dp
};

class ChainedOptimizer {
 public:
  ChainedOptimizer(ParamRegistry& params, const AdamWConfig& cfg, GradNormSync sync = {});
  // The distributed optimizer: both AdamWs over this rank's owned elements (moments for those
  // only); after both updates sharded.gather_params makes the values whole on every rank.
  ChainedOptimizer(ParamRegistry& params, const AdamWConfig& cfg, GradNormSync sync,
                   const ShardedState& sharded);

  // norm = sqrt(dense sum of squares (over TP) + expert sum of squares over EP (TP x EP));
  // coeff = Megatron's clip
  // coefficient from it; both AdamWs update with that coefficient. Collective over EP. The
  // scalars stay in the step buffers from the sums to the updates; the host reads the result
  // once, after both updates (read_step_info). veto: n flags in planned memory (the numeric
  // guard's, null: none); any non-zero one skips both updates (ops::skip_if_flagged), on the
  // device, after the norm is computed.
  void apply(double lr, DevPtr<const int32_t> veto = nullptr, int64_t n_veto = 0);
  StepInfo last_step() const { return read_step_info(arena_.exec(), buf_, cfg_.clip_grad); }
  // apply() then last_step() (tests, tools).
  StepInfo step(double lr) {
    apply(lr);
    return last_step();
  }
  int64_t steps_taken() const { return dense_.steps_taken(); }
  void set_steps_taken(int64_t n) {
    dense_.set_steps_taken(n);
    expert_.set_steps_taken(n);
  }
  // Parameter p's moments, from the AdamW of its kind.
  DevPtr<float> exp_avg(const Param& p) const { return of(p).exp_avg(p); }
  DevPtr<float> exp_avg_sq(const Param& p) const { return of(p).exp_avg_sq(p); }
  bool sharded() const { return dense_.sharded(); }
  int64_t state_bytes(MemKind kind) const {
    return dense_.arena().bytes_of(kind) + expert_.arena().bytes_of(kind);
  }
  int64_t planned_bytes() const {
    return dense_.arena().planned_bytes() + expert_.arena().planned_bytes();
  }
  const AdamWOptimizer& dense() const { return dense_; }
  const AdamWOptimizer& expert() const { return expert_; }

 private:
  const AdamWOptimizer& of(const Param& p) const {
    return p.spec.kind == ParamKind::Dense ? dense_ : expert_;
  }
  AdamWConfig cfg_;
  GradNormSync sync_;
  AdamWOptimizer dense_;
  AdamWOptimizer expert_;
  Arena arena_;  // the step's scalars, shared by both updates
  OptimizerStepBuffers buf_;
  std::function<void()> gather_params_;
};

}  // namespace moecore::optim
