// The training loop: a global batch of the synthetic language per iteration, split into
// micro-batches with gradient accumulation, AdamW with the LR schedule and global-norm
// clipping, and a log line every --log-interval iterations.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <vector>

#include "data/synthetic_language.h"
#include "model/config.h"
#include "model/gpt_model.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"

namespace moecore::train {

struct TrainConfig {
  int64_t micro_batch = 8;    // --micro-batch-size
  int64_t global_batch = 16;  // --global-batch-size
  int64_t train_iters = 300;  // --train-iters
  int64_t log_interval = 25;  // --log-interval
  uint64_t seed = 1234;       // --seed
  int64_t synthetic_branching = 4;
  optim::LrSchedule lr;
  optim::AdamWConfig adam;
  void validate() const;
};

struct StepMetrics {
  int64_t iteration = 0;
  double lm_loss = 0;     // mean over the global batch
  double aux_loss = 0;    // mean over MoE layers of aux / coeff (1.0 = perfectly balanced)
  double z_loss = 0;      // mean over MoE layers of z / coeff
  double lr = 0;
  double grad_norm = 0;
  double seconds = 0;
  double tokens_per_s = 0;
  double max_over_mean_load = 0;  // over experts, summed over layers and micro-batches
};

class Trainer {
 public:
  Trainer(const ModelConfig& model_cfg, const TrainConfig& cfg);

  // Runs train_iters iterations, logging to `log`; returns the metrics of every iteration.
  std::vector<StepMetrics> run(std::ostream& log);
  StepMetrics train_step();

  double entropy_floor() const { return language_.entropy_rate(); }
  model::GPTModel<float>& model() { return *model_; }

 private:
  ModelConfig model_cfg_;
  TrainConfig cfg_;
  data::SyntheticLanguage language_;
  std::unique_ptr<model::GPTModel<float>> model_;
  std::unique_ptr<optim::AdamWOptimizer> optimizer_;
  std::vector<int32_t> ids_, targets_, scratch_;  // sized once, before step 0
  std::vector<int64_t> load_;
  int64_t iteration_ = 0;
};

}  // namespace moecore::train
