// AdamW over a parameter registry (all parameters or one kind): moments planned in an arena, the
// gradient sum of squares for the global norm, Megatron's clip coefficient, and the update.
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/adamw.h"
#include "ops/sum_squares.h"

namespace moecore::optim {

void AdamWConfig::validate() const {
  MOE_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
            "[optimizer] --adam-beta1={} and --adam-beta2={} must be in [0, 1)", beta1, beta2);
  MOE_CHECK(eps > 0, "[optimizer] --adam-eps={} must be > 0", eps);
  MOE_CHECK(weight_decay >= 0, "[optimizer] --weight-decay={} must be >= 0", weight_decay);
  MOE_CHECK(clip_grad >= 0, "[optimizer] --clip-grad={} must be >= 0", clip_grad);
}

double grad_sum_squares(const ParamRegistry& params, ParamKind k) {
  double s = 0.0;
  if (params.numel(k) == 0) return s;
  if (params.dtype() == DType::F32) {
    ops::sum_squares(params.exec(), &s, static_cast<const float*>(params.flat_grad(k)),
                     params.numel(k));
  } else {
    ops::sum_squares(params.exec(), &s, static_cast<const double*>(params.flat_grad(k)),
                     params.numel(k));
  }
  return s;
}

double global_grad_norm(const ParamRegistry& params) {
  double s = 0;
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) s += grad_sum_squares(params, k);
  return std::sqrt(s);
}

double clip_coefficient(double grad_norm, double max_norm, int64_t step) {
  MOE_CHECK(std::isfinite(grad_norm),
            "[optimizer] gradient norm is {} at step {}: lower --lr or enable --clip-grad",
            grad_norm, step);
  if (max_norm > 0) {
    double c = max_norm / (grad_norm + 1e-6);
    if (c < 1.0) return c;
  }
  return 1.0;
}

AdamWOptimizer::AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg)
    : params_(params), cfg_(cfg), arena_(params.exec()) {
  plan();
}

AdamWOptimizer::AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg, ParamKind only)
    : params_(params), cfg_(cfg), all_kinds_(false), only_(only), arena_(params.exec()) {
  plan();
}

void adamw_state_layout(Arena& a, const int64_t numel[2], float* m[2], float* v[2]) {
  for (int k = 0; k < 2; ++k) {
    m[k] = a.alloc<float>(numel[k], "adam.m", MemKind::OptimizerState);
    v[k] = a.alloc<float>(numel[k], "adam.v", MemKind::OptimizerState);
  }
}

void AdamWOptimizer::plan() {
  cfg_.validate();
  // Planned for both kinds; a one-kind optimizer leaves the other's state empty.
  int64_t n[2];
  for (int k = 0; k < 2; ++k) {
    n[k] = covers(static_cast<ParamKind>(k)) ? params_.numel(static_cast<ParamKind>(k)) : 0;
  }
  arena_.plan([this, &n](Arena& a) { adamw_state_layout(a, n, m_, v_); });
}

template <typename T>
void AdamWOptimizer::update_typed(double lr, double grad_scale) {
  for (Param& p : params_.params()) {
    if (!covers(p.spec.kind)) continue;
    const int k = static_cast<int>(p.spec.kind);
    ops::AdamWParams a;
    a.lr = lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = p.spec.weight_decay ? cfg_.weight_decay : 0.0;
    a.step = step_;
    a.grad_scale = grad_scale;
    // --bf16: the compute copy is written in the same pass, so refresh_bf16 can skip it.
    bf16* p16 = std::is_same_v<T, float> ? p.data16 : nullptr;
    float* p16w = std::is_same_v<T, float> ? p.data16w : nullptr;
    ops::adamw_step(arena_.exec(), p.data_as<T>(), p.grad_as<T>(), m_[k] + p.offset,
                    v_[k] + p.offset, p.local_numel(), a, p16, p16w);
  }
  if (std::is_same_v<T, float> && params_.has_bf16_copies()) {
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      if (covers(k)) params_.mark_bf16_current(k);
    }
  }
}

double AdamWOptimizer::grad_sum_squares() const {
  double s = 0;
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    if (covers(k)) s += optim::grad_sum_squares(params_, k);
  }
  return s;
}

void AdamWOptimizer::update(double lr, double clip_coeff) {
  ++step_;
  if (params_.dtype() == DType::F32)
    update_typed<float>(lr, clip_coeff);
  else
    update_typed<double>(lr, clip_coeff);
}

StepInfo AdamWOptimizer::step(double lr) {
  ScopedPhase phase(Phase::Optimizer);
  StepInfo info;
  info.grad_norm = std::sqrt(grad_sum_squares());
  info.clip_coeff = clip_coefficient(info.grad_norm, cfg_.clip_grad, step_ + 1);
  update(lr, info.clip_coeff);
  return info;
}

}  // namespace moecore::optim
