// End to end: the tiny default model trained with loss-free balancing (sigmoid + expert bias,
// no aux loss; quantile balancing) reaches a max/mean expert load below 1.3, while the same
// run with no balancing at all stays above it. A shortened run (the full default run's numbers
// are in docs/router.md); the load is the trainer's step metric (summed over layers and
// micro-batches), averaged over the last steps.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/tiny_train_flags.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore::cli {
namespace {

constexpr int64_t kIters = 60;
constexpr int64_t kTail = 10;

double tail_load(const std::vector<std::string>& lb, bool sigmoid_bias) {
  TrainFlags f = tiny_train_flags();
  f.untie_embeddings = true;  // the default run (configs/tiny.toml)
  f.peak_tflops = 0.1;        // skip the start-up GEMM probe
  f.train.train_iters = kIters;
  f.router.load_balancing = lb;
  f.router.aux_loss_coeff = {0.0};
  if (sigmoid_bias) {
    f.router.score_function = "sigmoid";
    f.model.moe.router.enable_expert_bias = true;
  }
  finalize_train_flags(f);
  train::Trainer trainer(f.model, f.train);
  double sum = 0;
  for (int64_t it = 0; it < kIters; ++it) {
    train::StepMetrics m = trainer.train_step();
    if (it >= kIters - kTail) sum += m.max_over_mean_load;
  }
  return sum / kTail;
}

TEST(RouterEndToEnd, LossFreeBalancingBringsMaxOverMeanLoadBelow1p3) {
  const double none = tail_load({"none"}, false);
  const double bias = tail_load({"none"}, true);
  const double quantile = tail_load({"quantile_balancing"}, false);
  RecordProperty("max_over_mean_none", std::to_string(none));
  RecordProperty("max_over_mean_expert_bias", std::to_string(bias));
  RecordProperty("max_over_mean_quantile", std::to_string(quantile));
  std::printf("max/mean expert load over the last %lld of %lld steps: no balancing %.3f, "
              "sigmoid + expert bias %.3f, quantile balancing %.3f\n",
              static_cast<long long>(kTail), static_cast<long long>(kIters), none, bias, quantile);
  EXPECT_GT(none, 1.3) << "the unbalanced baseline must be above the bar for the test to mean anything";
  EXPECT_LT(bias, 1.3);
  EXPECT_LT(quantile, 1.3);
}

}  // namespace
}  // namespace moecore::cli
