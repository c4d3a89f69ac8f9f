// Checkpoints through the trainer: N steps, save, a fresh trainer loads, N more steps == an
// uninterrupted 2N-step run, bitwise (losses, grad norms, weights), with jitter, z-loss, the
// expert bias and quantile balancing in the run state; a weights-only load; and a checkpoint of
// another model is refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "ckpt/checkpoint_dir.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "train/trainer.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

train::TrainFlags resume_flags(int64_t iters, bool quantile) {
  train::TrainFlags f = train::tiny_train_flags();
  f.vocab_size = 64;
  f.model.hidden = 32;
  f.model.seq_length = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 32;
  f.model.moe.router.z_loss_coeff = 1e-3;
  f.model.moe.router.input_jitter_eps = 0.01;
  if (quantile) {
    f.router.load_balancing = {"quantile_balancing"};
    f.model.moe.router.aux_loss_coeff = 0;  // balances without a loss
  } else {
    f.router.score_function = "sigmoid";
    f.model.moe.router.enable_expert_bias = true;
    f.model.moe.router.bias_update_rate = 1e-3;
  }
  f.make_vocab_size_divisible_by = 64;
  f.train.train_iters = iters;
  f.train.micro_batch = 4;
  f.train.global_batch = 8;
  f.train.log_interval = 1000;
  f.train.lr.warmup_steps = 2;
  f.train.peak_gflops = 100;  // skip the start-up GEMM probe
  train::finalize_train_flags(f);
  return f;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moecore_resume." + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(CheckpointResume, SaveLoadContinueEqualsAnUninterruptedRunBitwise) {
  for (bool quantile : {false, true}) {
    SCOPED_TRACE(quantile ? "quantile balancing" : "expert bias");
    const train::TrainFlags f = resume_flags(6, quantile);
    const fs::path dir = fresh_dir(quantile ? "quantile" : "bias");
    train::Trainer whole(f.model, f.train);
    std::vector<train::StepMetrics> ref;
    for (int i = 0; i < 6; ++i) ref.push_back(whole.train_step());

    train::Trainer first(f.model, f.train);
    for (int i = 0; i < 3; ++i) first.train_step();
    first.save_checkpoint(dir);
    EXPECT_EQ(ckpt::read_tracker(dir), 3);

    train::Trainer second(f.model, f.train);
    second.load_checkpoint(dir);
    EXPECT_EQ(second.iteration(), 3);
    EXPECT_EQ(second.consumed_train_samples(), first.consumed_train_samples());
    EXPECT_EQ(second.weights_digest(), first.weights_digest());
    for (int i = 3; i < 6; ++i) {
      const train::StepMetrics m = second.train_step();
      EXPECT_EQ(m.iteration, ref[i].iteration);
      EXPECT_EQ(m.lm_loss, ref[i].lm_loss) << "iteration " << i + 1;
      EXPECT_EQ(m.grad_norm, ref[i].grad_norm) << "iteration " << i + 1;
      EXPECT_EQ(m.lr, ref[i].lr) << "iteration " << i + 1;
    }
    EXPECT_EQ(second.weights_digest(), whole.weights_digest());
    fs::remove_all(dir);
  }
}

// Without the optimizer state the weights and the data position still load; the moments start
// from zero, so the next step differs from the uninterrupted run's.
TEST(CheckpointResume, WeightsOnlyLoadKeepsTheWeightsNotTheMoments) {
  const train::TrainFlags f = resume_flags(4, false);
  const fs::path dir = fresh_dir("weights_only");
  train::Trainer a(f.model, f.train);
  for (int i = 0; i < 2; ++i) a.train_step();
  a.save_checkpoint(dir);
  train::Trainer b(f.model, f.train);
  b.load_checkpoint(dir, /*load_optim=*/false);
  EXPECT_EQ(b.weights_digest(), a.weights_digest());
  const train::StepMetrics ma = a.train_step(), mb = b.train_step();
  EXPECT_EQ(ma.lm_loss, mb.lm_loss);  // the same weights see the same batch
  EXPECT_NE(ma.grad_norm, 0.0);
  EXPECT_NE(a.weights_digest(), b.weights_digest());  // fresh moments, another update
  fs::remove_all(dir);
}

TEST(CheckpointResume, RefusesACheckpointOfAnotherModel) {
  const train::TrainFlags f = resume_flags(4, false);
  const fs::path dir = fresh_dir("other_model");
  train::Trainer a(f.model, f.train);
  a.train_step();
  a.save_checkpoint(dir);
  train::TrainFlags g = resume_flags(4, false);
  g.model.moe.ffn_hidden = 48;
  train::finalize_train_flags(g);
  train::Trainer b(g.model, g.train);
  EXPECT_NE(testing::error_of([&] {
              b.load_checkpoint(dir);
            }).find("a checkpoint loads only into the model that wrote it"),
            std::string::npos);
  EXPECT_NE(
      testing::error_of([&] { b.load_checkpoint(dir / "nothing"); }).find("holds no checkpoint"),
      std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moecore
