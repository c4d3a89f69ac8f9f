#include "train/trainer.h"

#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <ostream>

#include "core/check.h"
#include "ops/gemm_probe.h"
#include "train/progress.h"

namespace moecore::train {

void TrainConfig::validate() const {
  MOE_CHECK(micro_batch >= 1 && global_batch >= 1 && global_batch % micro_batch == 0,
            "[train] --global-batch-size={} must be a positive multiple of --micro-batch-size={}",
            global_batch, micro_batch);
  MOE_CHECK(train_iters >= 1, "[train] --train-iters={} must be >= 1", train_iters);
  MOE_CHECK(log_interval >= 1, "[train] --log-interval={} must be >= 1", log_interval);
  MOE_CHECK(peak_gflops >= 0, "[train] --peak-tflops must be >= 0");
  lr.validate();
  adam.validate();
}

Trainer::Trainer(const ModelConfig& model_cfg, const TrainConfig& cfg)
    : model_cfg_(model_cfg), cfg_(cfg) {
  if (cfg_.lr.decay_steps == 0) cfg_.lr.decay_steps = cfg_.train_iters;
  cfg_.validate();
  model_cfg_.validate();
  data_ = data::make_token_source(cfg_.data, model_cfg_.seq_length, cfg_.seed);
  MOE_CHECK(data_->vocab() <= model_cfg_.vocab_size,
            "[train] the data has {} token ids but --vocab-size={}: raise --vocab-size",
            data_->vocab(), model_cfg_.vocab_size);
  model_ = std::make_unique<model::GPTModel<float>>(model_cfg_, cfg_.micro_batch, cfg_.seed);
  optimizer_ = std::make_unique<optim::AdamWOptimizer>(model_->params(), cfg_.adam);
  flops_ = flops_model(model_cfg_);
  // The MFU denominator: the GEMM rate of this machine now, at this thread count, at the
  // training precision (bf16 inputs with --bf16).
  peak_gflops_ = cfg_.peak_gflops > 0
                     ? cfg_.peak_gflops
                     : ops::measure_gemm_gflops(model_cfg_.bf16, 1024, 1024, 1024, 0.3);
  const int64_t S = model_cfg_.seq_length;
  ids_.resize(cfg_.micro_batch * S);
  targets_.resize(cfg_.micro_batch * S);
  scratch_.resize(S + 1);
  load_.resize(std::max<int64_t>(model_cfg_.num_experts, 1));
}

StepMetrics Trainer::train_step() {
  auto t0 = std::chrono::steady_clock::now();
  profiler_.reset();
  ActiveProfiler active(&profiler_);
  std::optional<ScopedPhase> step_phase(Phase::Other);
  const int64_t n_micro = cfg_.global_batch / cfg_.micro_batch;
  const int64_t S = model_cfg_.seq_length;
  StepMetrics m;
  m.iteration = ++iteration_;
  m.lr = cfg_.lr.lr(optimizer_->steps_taken());
  std::fill(load_.begin(), load_.end(), 0);
  model_->params().zero_grads();
  int64_t moe_layers = 0;
  for (int64_t mb = 0; mb < n_micro; ++mb) {
    uint64_t first =
        static_cast<uint64_t>((iteration_ - 1) * cfg_.global_batch + mb * cfg_.micro_batch);
    data::make_batch(*data_, ids_.data(), targets_.data(), cfg_.micro_batch, S, first,
                     scratch_.data());
    m.lm_loss += model_->forward(ids_.data(), targets_.data()) / n_micro;
    // Megatron averages the loss over micro-batches: each backward carries 1 / n_micro.
    model_->backward(1.0 / n_micro);
    model::MoeStats st = model_->moe_stats();
    moe_layers = st.num_moe_layers;
    if (moe_layers > 0) {
      m.aux_loss += st.aux_value / moe_layers / n_micro;
      m.z_loss += st.z_value / moe_layers / n_micro;
      m.dropped_tokens += st.dropped;
      for (size_t e = 0; e < st.tokens_per_expert.size(); ++e) load_[e] += st.tokens_per_expert[e];
    }
  }
  optim::StepInfo info = optimizer_->step(m.lr);
  m.grad_norm = info.grad_norm;
  // Once per step, after the update: expert-bias and quantile updates, balancing counts reset.
  model_->finish_step();
  if (moe_layers > 0) {
    double sum = 0, mx = 0;
    for (int64_t c : load_) {
      sum += c;
      mx = std::max(mx, static_cast<double>(c));
    }
    m.max_over_mean_load = sum > 0 ? mx / (sum / load_.size()) : 0;
  }
  step_phase.reset();
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int p = 0; p < kNumPhases; ++p) m.phase_seconds[p] = profiler_.seconds(static_cast<Phase>(p));
  const double tokens = static_cast<double>(cfg_.global_batch * S);
  m.tokens_per_s = tokens / m.seconds;
  m.tflops = flops_.train_flops_per_token() * m.tokens_per_s / 1e12;
  m.mfu = m.tflops * 1e3 / peak_gflops_;
  m.peak_mem_bytes = peak_rss_bytes();
  for (int k = 0; k < static_cast<int>(MemKind::Count); ++k) {
    const MemKind kind = static_cast<MemKind>(k);
    m.mem_bytes[k] = static_cast<int64_t>(model_->arena().bytes_of(kind) +
                                          optimizer_->arena().bytes_of(kind));
  }
  return m;
}

void Trainer::print_header(std::ostream& log) const {
  const auto& p = model_->params();
  const Arena& ma = model_->arena();
  const Arena& oa = optimizer_->arena();
  constexpr double kMiB = 1024.0 * 1024.0;
  fmt::print(log, "[train] data: {}\n", data_->describe());
  if (!std::isnan(entropy_floor())) {
    fmt::print(log, "[train] entropy floor (best achievable lm loss): {:.4f} nats/token\n",
               entropy_floor());
  }
  fmt::print(log, "[train] parameters: {} ({} dense, {} expert); active matmul parameters per "
                  "token: {:.0f}\n",
             p.numel(ParamKind::Dense) + p.numel(ParamKind::Expert), p.numel(ParamKind::Dense),
             p.numel(ParamKind::Expert), flops_.active_matmul_params);
  fmt::print(log, "[train] memory plan (MiB): weights {:.2f}, grads {:.2f}, optimizer {:.2f}, "
                  "activations {:.2f}, workspace {:.2f}\n",
             ma.bytes_of(MemKind::Weights) / kMiB, ma.bytes_of(MemKind::Grads) / kMiB,
             oa.bytes_of(MemKind::OptimizerState) / kMiB, ma.bytes_of(MemKind::Activations) / kMiB,
             ma.bytes_of(MemKind::Workspace) / kMiB);
  fmt::print(log, "[train] MFU = (6 * active matmul params + 3 * attention fwd FLOPs) * tokens/s "
                  "/ peak; peak {} GEMM {}: {:.1f} GFLOP/s\n",
             model_cfg_.bf16 ? "bf16" : "fp32", cfg_.peak_gflops > 0 ? "(given)" : "(measured)",
             peak_gflops_);
}

std::vector<StepMetrics> Trainer::run(std::ostream& log) {
  print_header(log);
  MetricsFile metrics(cfg_.metrics_file);
  ProgressLine progress(log, cfg_.live_progress, cfg_.train_iters);
  std::vector<StepMetrics> all;
  StepMetrics acc;  // sums over the log interval
  int64_t in_interval = 0;
  double elapsed = 0;
  for (int64_t it = 0; it < cfg_.train_iters; ++it) {
    StepMetrics m = train_step();
    all.push_back(m);
    elapsed += m.seconds;
    acc.lm_loss += m.lm_loss;
    acc.aux_loss += m.aux_loss;
    acc.z_loss += m.z_loss;
    acc.seconds += m.seconds;
    for (int p = 0; p < kNumPhases; ++p) acc.phase_seconds[p] += m.phase_seconds[p];
    ++in_interval;
    progress.update(m.iteration, elapsed, m.lm_loss);
    if (m.iteration % cfg_.log_interval != 0 && m.iteration != cfg_.train_iters) continue;
    // Megatron logs interval means of the losses and the iteration time.
    StepMetrics logged = m;
    logged.lm_loss = acc.lm_loss / in_interval;
    logged.aux_loss = acc.aux_loss / in_interval;
    logged.z_loss = acc.z_loss / in_interval;
    logged.seconds = acc.seconds / in_interval;
    for (int p = 0; p < kNumPhases; ++p) logged.phase_seconds[p] = acc.phase_seconds[p] / in_interval;
    logged.tokens_per_s = cfg_.global_batch * model_cfg_.seq_length / logged.seconds;
    logged.tflops = flops_.train_flops_per_token() * logged.tokens_per_s / 1e12;
    logged.mfu = logged.tflops * 1e3 / peak_gflops_;
    acc = StepMetrics{};
    in_interval = 0;
    progress.clear();
    fmt::print(log,
               " iteration {:>6}/{:<6} | consumed samples: {:>9} | elapsed time per iteration "
               "(ms): {:.1f} | learning rate: {:.6E} | global batch size: {:>4} | lm loss: "
               "{:.6E} | load_balancing_loss: {:.6E} | z_loss: {:.6E} | grad norm: {:.4f} | "
               "tokens/s: {:.0f} | TFLOP/s: {:.4f} | MFU: {:.1f}% | max/mean expert load: {:.3f} "
               "| dropped tokens: {} | peak mem (MiB): {:.1f}\n",
               logged.iteration, cfg_.train_iters, logged.iteration * cfg_.global_batch,
               logged.seconds * 1e3, logged.lr, cfg_.global_batch, logged.lm_loss,
               logged.aux_loss, logged.z_loss, logged.grad_norm, logged.tokens_per_s,
               logged.tflops, logged.mfu * 100, logged.max_over_mean_load, logged.dropped_tokens,
               logged.peak_mem_bytes / (1024.0 * 1024.0));
    for (const auto& l : model_->moe_stats().layers) {  // last micro-batch, per MoE layer
      fmt::print(log, "   [router] layer {}: max/mean load {:.3f} | dropped {} | expert bias "
                      "[{:.4f}, {:.4f}] | quantile beta [{:.4f}, {:.4f}]\n",
                 l.layer, l.router.max_over_mean_load, l.router.dropped, l.router.bias_min,
                 l.router.bias_max, l.router.beta_min, l.router.beta_max);
    }
    log.flush();
    metrics.write(logged);
  }
  progress.clear();
  print_summary(log, all);
  return all;
}

void Trainer::print_summary(std::ostream& log, const std::vector<StepMetrics>& all) const {
  // Steady state: the first iterations (thread pools, page faults) are left out when possible.
  const size_t skip = all.size() > 4 ? 2 : 0;
  double seconds = 0;
  std::array<double, kNumPhases> phases{};
  for (size_t i = skip; i < all.size(); ++i) {
    seconds += all[i].seconds;
    for (int p = 0; p < kNumPhases; ++p) phases[p] += all[i].phase_seconds[p];
  }
  const double iters = static_cast<double>(all.size() - skip);
  const double tokens_per_s = iters * cfg_.global_batch * model_cfg_.seq_length / seconds;
  const double gflops = flops_.train_flops_per_token() * tokens_per_s / 1e9;
  std::string breakdown;
  for (int p = 0; p < kNumPhases; ++p) {
    breakdown += fmt::format("{}{} {:.1f} ms ({:.0f}%)", p ? ", " : "",
                             phase_name(static_cast<Phase>(p)), phases[p] / iters * 1e3,
                             100.0 * phases[p] / seconds);
  }
  fmt::print(log,
             "[summary] {:.0f} tokens/s | {:.1f} GFLOP/s | MFU {:.1f}% of {:.1f} GFLOP/s {} GEMM "
             "peak | step {:.1f} ms: {} | peak mem {:.1f} MiB\n",
             tokens_per_s, gflops, 100.0 * gflops / peak_gflops_, peak_gflops_,
             model_cfg_.bf16 ? "bf16" : "fp32",
             seconds / iters * 1e3, breakdown, all.back().peak_mem_bytes / (1024.0 * 1024.0));
}

}  // namespace moecore::train
