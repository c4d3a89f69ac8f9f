// Megatron's result checks of a training step (--check-for-nan-in-loss-and-grad, on by default;
// --check-for-spiky-loss; --check-for-large-grads) and --skip-spiky-steps. Each rank checks its
// own micro-batch losses and its gradient buckets before the data-parallel reduction, with ops
// that raise flags in planned memory; the flags are combined over the world (one all-reduce,
// ordered like the step's other collectives), veto the optimizer update on the device, and are
// read by the host once, after the step, with the step's other results (docs/flags.md,
// "Numeric guards").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/check.h"
#include "nn/param_registry.h"
#include "parallel/communicator.h"
#include "parallel/grad_buckets.h"

namespace moecore::train {

// Exit codes of a run stopped by a guard (docs/flags.md, "Numeric guards").
inline constexpr int kExitNonFinite = 17;  // Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
inline constexpr int kExitSpike = 18;      // a spiky loss or large gradients, not skipped

struct NumericGuardConfig {
  bool check_nan = true;           // --check-for-nan-in-loss-and-grad
  bool check_spiky_loss = false;   // --check-for-spiky-loss
  bool check_large_grads = false;  // --check-for-large-grads
  bool skip_spiky_steps = false;   // --skip-spiky-steps
  // Megatron's is_unexpectedly_large: the first `samples` finite values of each kind set the
  // reference maximum; later values >= factor x that maximum are flagged.
  int64_t samples = 100;  // --spike-check-samples (Megatron: 100)
  double factor = 10;     // Megatron's SPIKY_LOSS_FACTOR and large-grads threshold
  void validate() const;
  bool checks_spikes() const { return check_spiky_loss || check_large_grads; }
};

// A guard stopped the run. Every rank throws it at the same iteration (the flags are global);
// what() is this rank's finding (empty on a rank that found nothing), summary() the job's
// (the same on every rank; rank 0 prints it).
class NumericFault : public Error {
 public:
  NumericFault(const std::string& mine, std::string summary, int exit_code)
      : Error(mine), summary_(std::move(summary)), exit_code_(exit_code) {}
  const std::string& summary() const { return summary_; }
  int exit_code() const { return exit_code_; }

 private:
  std::string summary_;
  int exit_code_;
};

// Megatron's RerunStateMachine.is_unexpectedly_large for one kind of value, on the host: the
// maximum |value| over the first `samples` finite values observed; afterwards the threshold is
// factor x that maximum, fixed. NaN and Inf are not observed (the non-finite check's).
class LargeValueHistory {
 public:
  LargeValueHistory(int64_t samples, double factor) : samples_(samples), factor_(factor) {}
  void observe(double value);
  // +Inf while sampling: nothing is large yet.
  double threshold() const;
  int64_t observed() const { return count_; }
  double max() const { return max_; }

 private:
  int64_t samples_;
  double factor_;
  int64_t count_ = 0;
  double max_ = 0;
};

class NumericGuard {
 public:
  // world: the world's communicator of host memory, for the agreement on the flag count and
  // the job's summary (null: one rank). world_device: the world's communicator of the context's
  // memory, which the flags are combined over in the step (null: world serves both, as on the
  // CPU backend). rank: this process's world rank, for messages and the injected faults.
  NumericGuard(const NumericGuardConfig& cfg, const Exec& ex, ParamRegistry& params,
               const parallel::GradBuckets& buckets, parallel::Communicator* world, int rank,
               parallel::Communicator* world_device = nullptr);

  bool active() const { return cfg_.check_nan || cfg_.checks_spikes(); }
  // Before the step's first forward: clears the flags and writes this step's thresholds.
  void begin_step(int64_t iteration);
  // After micro-batch mb's forward: its loss (the sum over its counted tokens, Megatron's
  // loss_func value), in the step report.
  void check_loss(int64_t mb, DevPtr<double> loss_sum);
  // GradBuckets' before-reduce hook: bucket b's local gradients.
  void check_bucket(size_t b);
  // After every bucket is checked, before the optimizer: the flags over the world.
  void combine();
  // The optimizer's veto: any raised flag skips the update.
  DevPtr<const int32_t> veto() const { return global_; }
  int64_t veto_count() const { return n_flags_; }

  // After the step, at its sync point (the host reads the flags with the step's results).
  // Throws NumericFault when the run must stop; returns true when the step was skipped
  // (--skip-spiky-steps) and false for a clean step, whose values then join the histories.
  // losses: this rank's micro-batch loss sums, read from the step report.
  bool after_step(int64_t iteration, const std::vector<double>& losses);

  // The line of the last skipped step (rank 0 prints it).
  const std::string& skipped_summary() const { return skipped_summary_; }
  int64_t skipped_iteration() const { return skipped_iteration_; }
  const LargeValueHistory& loss_history() const { return loss_hist_; }
  const LargeValueHistory& grad_history() const { return grad_hist_; }

 private:
  // The flags: three of the step, then one per parameter (non-finite gradient), in bucket order:
  // each parameter's own flag is raised before the reduction, so a failure names it even where
  // the reduction rewrote the gradient buffer (the distributed optimizer's in-place
  // reduce-scatter keeps only the rank's own shard there).
  enum Flag : int { kLossNonFinite = 0, kSpikyLoss = 1, kLargeGrads = 2, kFirstParam = 3 };
  struct CheckedParam {
    const Param* p = nullptr;
    int64_t flag = 0;  // its index in the flags
  };
  void inject_grad_fault(size_t b);

  NumericGuardConfig cfg_;
  const Exec& ex_;
  ParamRegistry& params_;
  const parallel::GradBuckets& buckets_;
  parallel::Communicator* world_;
  parallel::Communicator* world_device_;  // the flags' all-reduce (the context's memory)
  int rank_;
  int64_t iteration_ = 0;
  int64_t n_flags_ = 0;
  Arena arena_;
  DevPtr<int32_t> local_ = nullptr;         // [n_flags]: this rank's findings
  DevPtr<int32_t> global_ = nullptr;        // [n_flags]: the max over the world
  DevPtr<double> thresholds_ = nullptr;     // [2]: loss, bucket sum of squares (step inputs)
  DevPtr<double> bucket_sum_sq_ = nullptr;  // [buckets]: --check-for-large-grads
  DevPtr<double> fault_value_ = nullptr;    // [1]: what an injected fault writes
  double threshold_host_[2] = {0, 0};
  double fault_host_ = 0;
  float fault_host32_ = 0;
  LargeValueHistory loss_hist_, grad_hist_;
  std::vector<std::vector<CheckedParam>> bucket_params_;  // per bucket
  std::vector<int32_t> flags_host_, local_host_;
  std::vector<double> sum_sq_host_;
  std::string skipped_summary_;
  int64_t skipped_iteration_ = -1;
};

}  // namespace moecore::train
