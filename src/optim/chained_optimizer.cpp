#include "optim/chained_optimizer.h"

#include <cmath>

#include "core/profiler.h"
#include "ops/grad_clip.h"
#include "ops/numeric_guard.h"

namespace moecore::optim {

ChainedOptimizer::ChainedOptimizer(ParamRegistry& params, const AdamWConfig& cfg, GradNormSync sync)
    : cfg_(cfg),
      sync_(std::move(sync)),
      dense_(params, cfg, ParamKind::Dense),
      expert_(params, cfg, ParamKind::Expert),
      arena_(params.exec()) {
  arena_.plan([this](Arena& a) { buf_.layout(a); });
  dense_.count_only(sync_.counted);
  expert_.count_only(sync_.counted);
}

ChainedOptimizer::ChainedOptimizer(ParamRegistry& params, const AdamWConfig& cfg,
                                   GradNormSync sync, const ShardedState& sharded)
    : cfg_(cfg),
      sync_(std::move(sync)),
      dense_(params, cfg, ParamKind::Dense, sharded),
      expert_(params, cfg, ParamKind::Expert, sharded),
      arena_(params.exec()),
      gather_params_(sharded.gather_params) {
  arena_.plan([this](Arena& a) { buf_.layout(a); });
  dense_.count_only(sync_.counted);
  expert_.count_only(sync_.counted);
}

void ChainedOptimizer::apply(double lr, DevPtr<const int32_t> veto, int64_t n_veto) {
  ScopedPhase phase(Phase::Optimizer);
  buf_.write_inputs(arena_.exec(), lr, steps_taken() + 1);
  dense_.grad_sum_squares(buf_.sum_sq);   // [0]
  expert_.grad_sum_squares(buf_.sum_sq);  // [1]
  if (sync_.sum_dense_shards || sync_.sum_expert_shards || sync_.sum_expert || sync_.sum_dense) {
    ScopedPhase comm(Phase::Communication);  // none on one rank: no time is booked to it
    if (sync_.sum_dense_shards) sync_.sum_dense_shards(buf_.sum_sq);
    if (sync_.sum_dense) sync_.sum_dense(buf_.sum_sq);
    if (sync_.sum_expert_shards) sync_.sum_expert_shards(buf_.sum_sq + 1);
    if (sync_.sum_expert) sync_.sum_expert(buf_.sum_sq + 1);
  }
  // Same association as global_grad_norm on one rank: (0 + dense) + expert.
  ops::grad_clip(arena_.exec(), buf_.norm, buf_.step, buf_.sum_sq, 2, cfg_.clip_grad);
  if (veto != nullptr) ops::skip_if_flagged(arena_.exec(), buf_.step, veto, n_veto);
  dense_.update(buf_.step);
  expert_.update(buf_.step);
  if (gather_params_) gather_params_();
}

}  // namespace moecore::optim
