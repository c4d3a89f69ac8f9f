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

// L2 norm of all gradients of `params` (dense and expert), accumulated in f64.
double global_grad_norm(const ParamRegistry& params);

class AdamWOptimizer {
 public:
  AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg);
  // Norm, clip coefficient and one AdamW update at learning rate lr; the step counter advances.
  StepInfo step(double lr);
  int64_t steps_taken() const { return step_; }
  const Arena& arena() const { return arena_; }

 private:
  template <typename T>
  void update(double lr, double grad_scale);

  ParamRegistry& params_;
  AdamWConfig cfg_;
  Arena arena_;
  float* m_[2] = {nullptr, nullptr};
  float* v_[2] = {nullptr, nullptr};
  int64_t step_ = 0;
};

}  // namespace moecore::optim
