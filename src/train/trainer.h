// The training loop: the global batch of each iteration from a token source, split into
// micro-batches with gradient accumulation, AdamW with the LR schedule and global-norm clipping,
// log lines every --log-interval (Megatron's format plus throughput, MFU, expert load, memory),
// a live progress line on terminals and an optional JSON-lines metrics file.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "data/token_source.h"
#include "model/config.h"
#include "model/gpt_model.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "train/metrics.h"

namespace moecore::train {

struct TrainConfig {
  int64_t micro_batch = 8;    // --micro-batch-size
  int64_t global_batch = 16;  // --global-batch-size
  int64_t train_iters = 300;  // --train-iters
  int64_t log_interval = 25;  // --log-interval
  uint64_t seed = 1234;       // --seed
  data::DataConfig data;
  optim::LrSchedule lr;
  optim::AdamWConfig adam;
  std::string metrics_file;   // --metrics-file (JSON lines)
  double peak_gflops = 0;     // --peak-tflops * 1000; 0: measured at start-up
  bool live_progress = false; // a redrawn progress line (set when stdout is a terminal)
  void validate() const;
};

class Trainer {
 public:
  Trainer(const ModelConfig& model_cfg, const TrainConfig& cfg);

  // Runs train_iters iterations, logging to `log`; returns the metrics of every iteration.
  std::vector<StepMetrics> run(std::ostream& log);
  StepMetrics train_step();

  double entropy_floor() const { return data_->entropy_floor(); }
  double peak_gflops() const { return peak_gflops_; }
  model::GPTModel<float>& model() { return *model_; }

 private:
  void print_header(std::ostream& log) const;
  void print_summary(std::ostream& log, const std::vector<StepMetrics>& all) const;

  ModelConfig model_cfg_;
  TrainConfig cfg_;
  std::unique_ptr<data::TokenSource> data_;
  std::unique_ptr<model::GPTModel<float>> model_;
  std::unique_ptr<optim::AdamWOptimizer> optimizer_;
  FlopsModel flops_;
  double peak_gflops_ = 0;
  std::vector<int32_t> ids_, targets_, scratch_;  // sized once, before step 0
  std::vector<int64_t> load_;
  int64_t iteration_ = 0;
  PhaseProfiler profiler_;
};

}  // namespace moecore::train
