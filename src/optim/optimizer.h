// AdamW over the parameters of one registry: fp32 moment buffers planned in an arena, weight
// decay only on parameters that take it (not norms or biases), one global gradient norm over
// dense and expert parameters and one clipping coefficient (Megatron's clip_grad_norm).
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "core/param_registry.h"

namespace moecore::optim {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double clip_grad = 1.0;  // 0: no clipping
  void validate() const;
};

struct StepInfo {
  double grad_norm = 0;   // before clipping
  double clip_coeff = 1;  // applied to the gradients
};

// Sum of squares of the gradients of one kind, accumulated in f64.
double grad_sum_squares(const ParamRegistry& params, ParamKind kind);
// L2 norm of all gradients of `params` (dense and expert), accumulated in f64.
double global_grad_norm(const ParamRegistry& params);
// Megatron's clip_grad_norm coefficient: max_norm / (norm + 1e-6) when below 1, else 1 (and 1
// when clipping is off). Throws on a non-finite norm.
double clip_coefficient(double grad_norm, double max_norm, int64_t step);

// The moment buffers an AdamW over `numel` elements of each kind (dense, expert) plans: m and v
// in fp32 for each kind. The optimizer allocates this layout; `moecore plan` runs it in a sizing
// arena (Arena::size_only) with counts from a sized registry.
void adamw_state_layout(Arena& a, const int64_t numel[2], float* m[2], float* v[2]);

class AdamWOptimizer {
 public:
  // Over every parameter of the registry (dense and expert).
  AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg);
  // Over the parameters of one kind only (ChainedOptimizer holds one per kind).
  AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg, ParamKind only);
  // Norm, clip coefficient and one AdamW update at learning rate lr; the step counter advances.
  StepInfo step(double lr);
  // The pieces of step() for an optimizer that computes the norm over several: this
  // optimizer's sum of squared gradients, and the update with a given clip coefficient.
  double grad_sum_squares() const;
  void update(double lr, double clip_coeff);
  int64_t steps_taken() const { return step_; }
  const Arena& arena() const { return arena_; }

 private:
  void plan();
  template <typename T>
  void update_typed(double lr, double grad_scale);
  bool covers(ParamKind k) const { return all_kinds_ || k == only_; }

  ParamRegistry& params_;
  AdamWConfig cfg_;
  bool all_kinds_ = true;
  ParamKind only_ = ParamKind::Dense;
  Arena arena_;
  float* m_[2] = {nullptr, nullptr};
  float* v_[2] = {nullptr, nullptr};
  int64_t step_ = 0;
};

}  // namespace moecore::optim
