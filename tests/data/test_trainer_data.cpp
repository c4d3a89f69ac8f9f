// The trainer's data position: consumed samples advance by the global batch per step, can be
// set back for a resume, and a run on an indexed dataset evaluates on its validation split.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "common/tiny_train_flags.h"
#include "core/check.h"
#include "data/indexed_dataset.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore {
namespace {

std::string write_corpus() {
  const std::string p = (std::filesystem::temp_directory_path() /
                         ("moecore_trainer_data." + std::to_string(::getpid()))).string();
  data::IndexedDatasetBuilder b(p + ".bin", data::TokenDType::UInt16);
  for (int d = 0; d < 200; ++d) {
    std::vector<int64_t> t(20 + d % 17);
    for (size_t i = 0; i < t.size(); ++i) t[i] = (d * 31 + static_cast<int64_t>(i) * 3) % 256;
    b.add_item(t);
    b.end_document();
  }
  b.finalize(p + ".idx");
  return p;
}

cli::TrainFlags tiny(const std::string& prefix) {
  cli::TrainFlags f = cli::tiny_train_flags();
  f.model.hidden = 32;
  f.model.num_heads = 2;
  f.model.num_query_groups = 2;
  f.model.seq_length = 16;
  f.model.ffn_hidden = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 16;
  f.train.micro_batch = 2;
  f.train.global_batch = 4;
  f.train.train_iters = 3;
  f.train.lr.warmup_steps = 0;
  f.train.peak_gflops = 100;
  f.peak_tflops = 0.1;
  f.train.data.data_path = {prefix};
  f.train.data.split = "90,10,0";
  f.train.eval_iters = 2;
  cli::finalize_train_flags(f);
  return f;
}

TEST(TrainerData, ConsumedSamplesAdvanceAndResume) {
  const std::string p = write_corpus();
  cli::TrainFlags f = tiny(p);
  train::Trainer a(f.model, f.train);
  EXPECT_EQ(a.consumed_train_samples(), 0);
  a.train_step();
  a.train_step();
  EXPECT_EQ(a.consumed_train_samples(), 8);
  EXPECT_TRUE(a.has_eval_data(data::Split::Valid));
  EXPECT_FALSE(a.has_eval_data(data::Split::Test));  // a zero share
  const train::EvalMetrics e = a.evaluate(data::Split::Valid);
  EXPECT_EQ(e.samples, 8);
  EXPECT_EQ(a.consumed_valid_samples(), 8);
  EXPECT_GT(e.lm_loss, 0.0);
  EXPECT_DOUBLE_EQ(e.ppl, std::exp(e.lm_loss));
  // Evaluation is forward-only: training goes on from the same weights and data position.
  train::Trainer b(f.model, f.train);
  b.train_step();
  b.train_step();
  const double la = a.train_step().lm_loss, lb = b.train_step().lm_loss;
  EXPECT_EQ(la, lb);
  // A resumed position: a fresh trainer set to sample 8 reads step 3's batch (its loss with
  // fresh weights differs, but the position is what a checkpoint restores).
  train::Trainer c(f.model, f.train);
  c.set_consumed_train_samples(8);
  EXPECT_EQ(c.consumed_train_samples(), 8);
  EXPECT_THROW(c.set_consumed_train_samples(6), Error);
  std::remove((p + ".bin").c_str());
  std::remove((p + ".idx").c_str());
}

}  // namespace
}  // namespace moecore
