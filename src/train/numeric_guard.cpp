// The numeric guard: flags raised by ops inside the step, combined over the world, read once
// after the step; the histories of Megatron's is_unexpectedly_large on the host; the messages.
#include "train/numeric_guard.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "core/fault_injection.h"
#include "ops/memory.h"
#include "ops/numeric_guard.h"
#include "ops/sum_squares.h"

namespace moecore::train {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename T>
DevPtr<const T> grad_range(const ParamRegistry& p, ParamKind kind, int64_t offset) {
  return dev_ptr_cast<const T>(p.flat_grad(kind)) + offset;
}
}  // namespace

void NumericGuardConfig::validate() const {
  MOE_CHECK(samples >= 1, "[guard] --spike-check-samples={} must be >= 1", samples);
  MOE_CHECK(std::isfinite(factor) && factor > 0, "[guard] spike factor {} must be > 0", factor);
  MOE_CHECK(!skip_spiky_steps || checks_spikes(),
            "[guard] --skip-spiky-steps skips the steps --check-for-spiky-loss or "
            "--check-for-large-grads flag: give one of them");
}

void LargeValueHistory::observe(double value) {
  const double v = std::fabs(value);
  if (!std::isfinite(v) || count_ >= samples_) return;
  ++count_;
  max_ = std::max(max_, v);
}

double LargeValueHistory::threshold() const {
  return count_ < samples_ ? kInf : max_ * factor_;
}

NumericGuard::NumericGuard(const NumericGuardConfig& cfg, const Exec& ex, ParamRegistry& params,
                           const parallel::GradBuckets& buckets, parallel::Communicator* world,
                           int rank, parallel::Communicator* world_device)
    : cfg_(cfg),
      ex_(ex),
      params_(params),
      buckets_(buckets),
      world_(world),
      world_device_(world != nullptr && world_device != nullptr ? world_device : world),
      rank_(rank),
      arena_(ex),
      loss_hist_(cfg.samples, cfg.factor),
      grad_hist_(cfg.samples, cfg.factor) {
  cfg_.validate();
  const int64_t n_buckets = static_cast<int64_t>(buckets_.buckets().size());
  n_flags_ = kFirstParam;
  for (const parallel::GradBucket& bk : buckets_.buckets()) {
    std::vector<CheckedParam>& ps = bucket_params_.emplace_back();
    for (const std::string& name : bk.params) ps.push_back({&params_.get(name), n_flags_++});
  }
  // Pipeline stages hold different parameters: every rank combines as many flags as the rank
  // with the most (a flag's parameter is its own rank's; any raised flag vetoes the update
  // everywhere, and each rank names only its own parameters).
  if (world_ != nullptr) {
    std::vector<int64_t> most{n_flags_};
    world_->all_reduce(most, parallel::ReduceOp::Max);
    n_flags_ = most[0];
  }
  arena_.plan([&](Arena& a) {
    local_ = a.alloc<int32_t>(n_flags_, "guard.local_flags", MemKind::State);
    global_ = a.alloc<int32_t>(n_flags_, "guard.flags", MemKind::State);
    thresholds_ = a.alloc<double>(2, "guard.thresholds", MemKind::State);
    bucket_sum_sq_ = a.alloc<double>(std::max<int64_t>(n_buckets, 1), "guard.bucket_sum_sq",
                                     MemKind::State);
    fault_value_ = a.alloc<double>(1, "guard.fault_value", MemKind::State);
  });
  ops::zero(ex_, local_, n_flags_);
  ops::zero(ex_, global_, n_flags_);
  flags_host_.resize(n_flags_);
  local_host_.resize(n_flags_);
  sum_sq_host_.resize(std::max<int64_t>(n_buckets, 1));
  // An injected gradient fault naming a parameter this rank does not hold would be ignored: the
  // test that set it must not pass that way.
  for (const fault::Fault& f : fault::injected()) {
    if (f.kind != "inf_grad" || !f.matches(rank_, -1)) continue;
    if (const auto name = f.arg("param")) {
      MOE_CHECK(params_.find(*name) != nullptr,
                "[fault] MOECORE_FAULT inf_grad: rank {} holds no parameter '{}'", rank_, *name);
    }
  }
}

void NumericGuard::begin_step(int64_t iteration) {
  iteration_ = iteration;
  if (!active()) return;
  ops::zero(ex_, local_, n_flags_);
  // The thresholds are step inputs, like the learning rate: copied by an op, so the host values
  // must stay put until it has run.
  threshold_host_[0] = loss_hist_.threshold();
  const double g = grad_hist_.threshold();
  threshold_host_[1] = g * g;  // the buckets' sums of squares are compared, not their norms
  ops::copy<double>(ex_, thresholds_, threshold_host_, 2);
}

void NumericGuard::check_loss(int64_t mb, DevPtr<double> loss_sum) {
  // Injected faults replace this micro-batch's loss value (the report's), nothing else.
  for (const char* kind : {"nan_loss", "spike_loss"}) {
    const fault::Fault* f = fault::find(kind, rank_, iteration_);
    if (f == nullptr || f->int_arg("mb", 0) != mb) continue;
    fault_host_ = kind[0] == 'n' ? std::numeric_limits<double>::quiet_NaN()
                                 : static_cast<double>(f->int_arg("value", 1000000000000));
    ops::copy<double>(ex_, fault_value_, &fault_host_, 1);
    ops::copy<double>(ex_, loss_sum, fault_value_, 1);
  }
  if (cfg_.check_nan) ops::flag_nonfinite<double>(ex_, local_ + kLossNonFinite, loss_sum, 1);
  if (cfg_.check_spiky_loss) {
    ops::flag_at_least(ex_, local_ + kSpikyLoss, loss_sum, thresholds_);
  }
}

void NumericGuard::inject_grad_fault(size_t b) {
  const fault::Fault* f = fault::find("inf_grad", rank_, iteration_);
  if (f == nullptr) return;
  const parallel::GradBucket& bk = buckets_.buckets()[b];
  const std::optional<std::string> name = f->arg("param");
  // Default: the first parameter of bucket 0.
  const std::string target = name ? *name : (b == 0 && !bk.params.empty() ? bk.params[0] : "");
  bool here = false;
  for (const std::string& p : bk.params) here = here || p == target;
  if (!here) return;
  const Param& p = params_.get(target);
  // Element 0 of this rank's slice becomes +Inf (copied by an op, from host values that stay).
  if (params_.dtype() == DType::F32) {
    fault_host32_ = std::numeric_limits<float>::infinity();
    ops::copy<float>(ex_, p.grad_as<float>(), &fault_host32_, 1);
  } else {
    fault_host_ = kInf;
    ops::copy<double>(ex_, p.grad_as<double>(), &fault_host_, 1);
  }
}

void NumericGuard::check_bucket(size_t b) {
  inject_grad_fault(b);
  if (!cfg_.check_nan && !cfg_.check_large_grads) return;
  const parallel::GradBucket& bk = buckets_.buckets()[b];
  const bool f32 = params_.dtype() == DType::F32;
  if (cfg_.check_nan) {
    for (const CheckedParam& c : bucket_params_[b]) {
      DevPtr<int32_t> flag = local_ + c.flag;
      if (f32)
        ops::flag_nonfinite<float>(ex_, flag, c.p->grad_as<float>(), c.p->local_numel());
      else
        ops::flag_nonfinite<double>(ex_, flag, c.p->grad_as<double>(), c.p->local_numel());
    }
  }
  if (cfg_.check_large_grads) {
    DevPtr<double> sq = bucket_sum_sq_ + static_cast<int64_t>(b);
    if (f32)
      ops::sum_squares<float>(ex_, sq, grad_range<float>(params_, bk.kind, bk.offset), bk.count);
    else
      ops::sum_squares<double>(ex_, sq, grad_range<double>(params_, bk.kind, bk.offset), bk.count);
    ops::flag_at_least(ex_, local_ + kLargeGrads, sq, thresholds_ + 1);
  }
}

void NumericGuard::combine() {
  if (!active()) return;
  ops::copy<int32_t>(ex_, global_, local_, n_flags_);
  if (world_ != nullptr) {
    // Every rank skips (or stops) together: one rank's NaN or spike decides for the job.
    world_device_->all_reduce_async(global_, n_flags_, DType::I32, parallel::ReduceOp::Max)
        .wait_on(ex_);
  }
}

bool NumericGuard::after_step(int64_t iteration, const std::vector<double>& losses) {
  if (!active()) return false;
  ops::read_back<int32_t>(ex_, flags_host_.data(), global_, n_flags_);
  const int64_t n_buckets = static_cast<int64_t>(bucket_params_.size());
  if (cfg_.check_large_grads && n_buckets > 0) {
    ops::read_back<double>(ex_, sum_sq_host_.data(), bucket_sum_sq_, n_buckets);
  }
  bool any = false;
  for (int32_t f : flags_host_) any = any || f != 0;
  if (!any) {
    // A clean step's values join the histories (Megatron samples every checked value).
    if (cfg_.check_spiky_loss) {
      for (double l : losses) loss_hist_.observe(l);
    }
    if (cfg_.check_large_grads) {
      for (int64_t b = 0; b < n_buckets; ++b) grad_hist_.observe(std::sqrt(sum_sq_host_[b]));
    }
    return false;
  }
  // A failure: from here on the step is over and the run stops or skips; host reads are fine.
  ops::read_back<int32_t>(ex_, local_host_.data(), local_, n_flags_);
  std::vector<std::string> mine;
  if (local_host_[kLossNonFinite]) {
    for (size_t mb = 0; mb < losses.size(); ++mb) {
      if (!std::isfinite(losses[mb])) {
        mine.push_back(fmt::format("the loss of micro-batch {} is {}", mb, losses[mb]));
      }
    }
  }
  int32_t nonfinite = local_host_[kLossNonFinite];
  for (int64_t b = 0; b < n_buckets; ++b) {
    std::vector<std::string> names;
    for (const CheckedParam& c : bucket_params_[b]) {
      if (local_host_[c.flag]) names.push_back(c.p->name());
    }
    if (names.empty()) continue;
    nonfinite = 1;
    const auto& bk = buckets_.buckets()[b];
    mine.push_back(fmt::format(
        "a gradient is not finite in bucket #{} ({}) before the data-parallel reduction: "
        "parameter{} '{}'",
        b, bk.kind == ParamKind::Dense ? "dense" : "expert", names.size() == 1 ? "" : "s",
        fmt::join(names, "', '")));
  }
  if (local_host_[kSpikyLoss]) {
    for (size_t mb = 0; mb < losses.size(); ++mb) {
      const double v = std::fabs(losses[mb]);
      if (std::isfinite(v) && v >= threshold_host_[0]) {
        mine.push_back(fmt::format(
            "spiky loss: micro-batch {} loss {} >= {} x {} (the largest of the first {} losses)",
            mb, losses[mb], cfg_.factor, loss_hist_.max(), cfg_.samples));
      }
    }
  }
  if (local_host_[kLargeGrads]) {
    for (int64_t b = 0; b < n_buckets; ++b) {
      if (std::isfinite(sum_sq_host_[b]) && sum_sq_host_[b] >= threshold_host_[1]) {
        mine.push_back(fmt::format(
            "large gradients: bucket #{} norm {} >= {} x {} (the largest of the first {} bucket "
            "norms)",
            b, std::sqrt(sum_sq_host_[b]), cfg_.factor, grad_hist_.max(), cfg_.samples));
      }
    }
  }
  // What each rank found, for the job's summary: [non-finite, spike] per rank.
  const int32_t spike = local_host_[kSpikyLoss] | local_host_[kLargeGrads];
  std::vector<int32_t> me = {nonfinite, spike}, all = me;
  if (world_ != nullptr) {
    all.resize(2 * static_cast<size_t>(world_->size()));
    world_->all_gather(me, all);
  }
  bool job_nonfinite = false;
  std::string who;
  for (size_t r = 0; r * 2 < all.size(); ++r) {
    if (!all[2 * r] && !all[2 * r + 1]) continue;
    job_nonfinite = job_nonfinite || all[2 * r];
    who += fmt::format("{}rank {} ({})", who.empty() ? "" : ", ", r,
                       all[2 * r] ? "non-finite loss or gradient" : "spiky loss or large gradients");
  }
  const std::string found = fmt::format("[guard] rank {}, iteration {}: {}", rank_, iteration,
                                        fmt::join(mine, "; "));
  if (!job_nonfinite && cfg_.skip_spiky_steps) {
    skipped_summary_ = fmt::format(
        "[guard] iteration {} skipped (--skip-spiky-steps): {}; the weights, the optimizer state "
        "and the routers are those before it, its batch is consumed",
        iteration, who);
    skipped_iteration_ = iteration;
    return true;
  }
  const int code = job_nonfinite ? kExitNonFinite : kExitSpike;
  const std::string summary = fmt::format(
      "[guard] stopping at iteration {} (exit code {}): {}; its update was skipped on every rank "
      "and nothing of it was saved: the last checkpoint is intact{}",
      iteration, code, who,
      job_nonfinite ? "" : " (--skip-spiky-steps skips such steps instead)");
  throw NumericFault(mine.empty() ? std::string() : found, summary, code);
}

}  // namespace moecore::train
