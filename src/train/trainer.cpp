#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <ostream>

#include <fmt/ostream.h>

#include "core/check.h"

namespace moecore::train {

void TrainConfig::validate() const {
  MOE_CHECK(micro_batch >= 1 && global_batch >= 1 && global_batch % micro_batch == 0,
            "[train] --global-batch-size={} must be a positive multiple of --micro-batch-size={}",
            global_batch, micro_batch);
  MOE_CHECK(train_iters >= 1, "[train] --train-iters={} must be >= 1", train_iters);
  MOE_CHECK(log_interval >= 1, "[train] --log-interval={} must be >= 1", log_interval);
  lr.validate();
  adam.validate();
}

Trainer::Trainer(const ModelConfig& model_cfg, const TrainConfig& cfg)
    : model_cfg_(model_cfg),
      cfg_(cfg),
      language_(model_cfg.vocab_size, cfg.synthetic_branching, cfg.seed) {
  if (cfg_.lr.decay_steps == 0) cfg_.lr.decay_steps = cfg_.train_iters;
  cfg_.validate();
  model_ = std::make_unique<model::GPTModel<float>>(model_cfg_, cfg_.micro_batch, cfg_.seed);
  optimizer_ = std::make_unique<optim::AdamWOptimizer>(model_->params(), cfg_.adam);
  const int64_t S = model_cfg_.seq_length;
  ids_.resize(cfg_.micro_batch * S);
  targets_.resize(cfg_.micro_batch * S);
  scratch_.resize(S + 1);
  load_.resize(std::max<int64_t>(model_cfg_.num_experts, 1));
}

StepMetrics Trainer::train_step() {
  auto t0 = std::chrono::steady_clock::now();
  const int64_t n_micro = cfg_.global_batch / cfg_.micro_batch;
  const int64_t S = model_cfg_.seq_length;
  StepMetrics m;
  m.iteration = ++iteration_;
  m.lr = cfg_.lr.lr(optimizer_->steps_taken());
  std::fill(load_.begin(), load_.end(), 0);
  model_->params().zero_grads();
  int64_t moe_layers = 0;
  for (int64_t mb = 0; mb < n_micro; ++mb) {
    uint64_t first = static_cast<uint64_t>((iteration_ - 1) * cfg_.global_batch + mb * cfg_.micro_batch);
    data::synthetic_batch(language_, ids_.data(), targets_.data(), cfg_.micro_batch, S, first,
                          scratch_.data());
    m.lm_loss += model_->forward(ids_.data(), targets_.data()) / n_micro;
    // Megatron averages the loss over micro-batches: each backward carries 1 / n_micro.
    model_->backward(1.0 / n_micro);
    model::MoeStats st = model_->moe_stats();
    moe_layers = st.num_moe_layers;
    if (moe_layers > 0) {
      m.aux_loss += st.aux_value / moe_layers / n_micro;
      if (model_cfg_.moe.router.z_loss_coeff > 0) {
        m.z_loss += st.z_loss / model_cfg_.moe.router.z_loss_coeff / moe_layers / n_micro;
      }
      for (size_t e = 0; e < st.tokens_per_expert.size(); ++e) load_[e] += st.tokens_per_expert[e];
    }
  }
  optim::StepInfo info = optimizer_->step(m.lr);
  // Once per step after the update: expert-bias / quantile-beta updates, accumulators reset.
  model_->finish_step();
  m.grad_norm = info.grad_norm;
  if (moe_layers > 0) {
    double sum = 0, mx = 0;
    for (int64_t c : load_) {
      sum += c;
      mx = std::max(mx, static_cast<double>(c));
    }
    m.max_over_mean_load = sum > 0 ? mx / (sum / load_.size()) : 0;
  }
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.tokens_per_s = static_cast<double>(cfg_.global_batch * S) / m.seconds;
  return m;
}

std::vector<StepMetrics> Trainer::run(std::ostream& log) {
  fmt::print(log, "[train] {} parameters ({} dense, {} expert); entropy floor of the synthetic "
                  "language: {:.4f} nats/token\n",
             model_->params().numel(ParamKind::Dense) + model_->params().numel(ParamKind::Expert),
             model_->params().numel(ParamKind::Dense), model_->params().numel(ParamKind::Expert),
             entropy_floor());
  std::vector<StepMetrics> all;
  for (int64_t it = 0; it < cfg_.train_iters; ++it) {
    StepMetrics m = train_step();
    all.push_back(m);
    if (m.iteration % cfg_.log_interval == 0 || m.iteration == cfg_.train_iters) {
      fmt::print(log,
                 " iteration {:>6}/{:<6} | elapsed time per iteration (ms): {:.1f} | learning "
                 "rate: {:.6E} | global batch size: {} | lm loss: {:.6E} | load_balancing_loss: "
                 "{:.6E} | grad norm: {:.4f} | tokens/s: {:.0f} | max/mean expert load: {:.3f}\n",
                 m.iteration, cfg_.train_iters, m.seconds * 1e3, m.lr, cfg_.global_batch,
                 m.lm_loss, m.aux_loss, m.grad_norm, m.tokens_per_s, m.max_over_mean_load);
      for (const auto& l : model_->moe_stats().layers) {  // last micro-batch, per MoE layer
        fmt::print(log, "   [router] layer {}: max/mean load {:.3f} | dropped {} | expert bias "
                        "[{:.4f}, {:.4f}] | quantile beta [{:.4f}, {:.4f}]\n",
                   l.layer, l.router.max_over_mean_load, l.router.dropped, l.router.bias_min,
                   l.router.bias_max, l.router.beta_min, l.router.beta_max);
      }
      log.flush();
    }
  }
  return all;
}

}  // namespace moecore::train
