#include "optim/chained_optimizer.h"

#include <cmath>

#include "core/profiler.h"

namespace moecore::optim {

ChainedOptimizer::ChainedOptimizer(ParamRegistry& params, const AdamWConfig& cfg, GradNormSync sync)
    : cfg_(cfg),
      sync_(std::move(sync)),
      dense_(params, cfg, ParamKind::Dense),
      expert_(params, cfg, ParamKind::Expert) {}

StepInfo ChainedOptimizer::step(double lr) {
  ScopedPhase phase(Phase::Optimizer);
  StepInfo info;
  const double dense_sq = dense_.grad_sum_squares();
  double expert_sq = expert_.grad_sum_squares();
  if (sync_.sum_expert) {
    ScopedPhase comm(Phase::Communication);
    sync_.sum_expert(&expert_sq);
  }
  // Same association as global_grad_norm on one rank: (0 + dense) + expert.
  info.grad_norm = std::sqrt(0.0 + dense_sq + expert_sq);
  info.clip_coeff = clip_coefficient(info.grad_norm, cfg_.clip_grad, steps_taken() + 1);
  dense_.update(lr, info.clip_coeff);
  expert_.update(lr, info.clip_coeff);
  return info;
}

}  // namespace moecore::optim
