#include "optim/optimizer.h"
#include "core/profiler.h"

#include <cmath>

#include "core/check.h"
#include "ops/adamw.h"

namespace moecore::optim {

void AdamWConfig::validate() const {
  MOE_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
            "[optimizer] --adam-beta1={} and --adam-beta2={} must be in [0, 1)", beta1, beta2);
  MOE_CHECK(eps > 0, "[optimizer] --adam-eps={} must be > 0", eps);
  MOE_CHECK(weight_decay >= 0, "[optimizer] --weight-decay={} must be >= 0", weight_decay);
  MOE_CHECK(clip_grad >= 0, "[optimizer] --clip-grad={} must be >= 0", clip_grad);
}

template <typename T>
static double sum_squares(const T* g, int64_t n) {
  double s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  return s;
}

double global_grad_norm(const ParamRegistry& params) {
  double s = 0;
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    if (params.numel(k) == 0) continue;
    if (params.dtype() == DType::F32) {
      s += sum_squares(static_cast<const float*>(params.flat_grad(k)), params.numel(k));
    } else {
      s += sum_squares(static_cast<const double*>(params.flat_grad(k)), params.numel(k));
    }
  }
  return std::sqrt(s);
}

AdamWOptimizer::AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg)
    : params_(params), cfg_(cfg) {
  cfg_.validate();
  arena_.plan([this](Arena& a) {
    for (int k = 0; k < 2; ++k) {
      int64_t n = params_.numel(static_cast<ParamKind>(k));
      m_[k] = a.alloc<float>(n, "adam.m", MemKind::OptimizerState);
      v_[k] = a.alloc<float>(n, "adam.v", MemKind::OptimizerState);
    }
  });
}

template <typename T>
void AdamWOptimizer::update(double lr, double grad_scale) {
  for (Param& p : params_.params()) {
    const int k = static_cast<int>(p.spec.kind);
    ops::AdamWParams a;
    a.lr = lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = p.spec.weight_decay ? cfg_.weight_decay : 0.0;
    a.step = step_;
    a.grad_scale = grad_scale;
    ops::adamw_step(p.data_as<T>(), p.grad_as<T>(), m_[k] + p.offset, v_[k] + p.offset,
                    p.local_numel(), a);
  }
}

StepInfo AdamWOptimizer::step(double lr) {
  ScopedPhase phase(Phase::Optimizer);
  StepInfo info;
  info.grad_norm = global_grad_norm(params_);
  MOE_CHECK(std::isfinite(info.grad_norm),
            "[optimizer] gradient norm is {} at step {}: lower --lr or enable --clip-grad",
            info.grad_norm, step_ + 1);
  if (cfg_.clip_grad > 0) {
    double c = cfg_.clip_grad / (info.grad_norm + 1e-6);
    if (c < 1.0) info.clip_coeff = c;
  }
  ++step_;
  if (params_.dtype() == DType::F32) update<float>(lr, info.clip_coeff);
  else update<double>(lr, info.clip_coeff);
  return info;
}

}  // namespace moecore::optim
