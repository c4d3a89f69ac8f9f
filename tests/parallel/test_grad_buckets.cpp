// Gradient buckets on one process: the model's backward stages (every parameter once, the hook
// fires stage by stage), buckets that tile the flat gradient buffers in backward order (one per
// stage by default, by size with --ddp-bucket-size), and no communication for groups of one.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <set>
#include <vector>

#include "model/gpt_model.h"
#include "parallel/grad_buckets.h"
#include "common/tiny_train_flags.h"
#include "cli/train_flags.h"

namespace moecore::parallel {
namespace {

cli::TrainFlags tiny_flags(bool untie) {
  cli::TrainFlags f = cli::tiny_train_flags();
  f.vocab_size = 64;
  f.make_vocab_size_divisible_by = 64;
  f.model.hidden = 16;
  f.model.num_heads = 2;
  f.model.seq_length = 8;
  f.model.num_layers = 3;
  f.model.ffn_hidden = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 8;
  f.model.moe.shared_ffn_hidden = 8;
  f.moe_layer_freq = "[1,0,1]";
  f.untie_embeddings = untie;
  f.train.micro_batch = 2;
  f.train.global_batch = 2;
  cli::finalize_train_flags(f);
  return f;
}

TEST(GradStages, EveryParameterOnceAndTheHookFiresInOrder) {
  for (bool untie : {false, true}) {
    cli::TrainFlags f = tiny_flags(untie);
    model::GPTModel<double> m(f.model, 2, 7);
    const auto& stages = m.grad_stages();
    ASSERT_EQ(stages.size(), 3u + 2u);
    std::set<const Param*> seen;
    for (const auto& s : stages) {
      for (const Param* p : s) EXPECT_TRUE(seen.insert(p).second) << p->name() << " twice";
    }
    EXPECT_EQ(seen.size(), m.params().params().size());
    EXPECT_EQ(stages.front().front()->name(), "decoder.final_layernorm.weight");
    EXPECT_EQ(stages.front().size(), untie ? 2u : 1u);
    EXPECT_EQ(stages.back().size(), 1u);
    EXPECT_EQ(stages.back().front()->name(), "embedding.word_embeddings.weight");
    // Stage 1 is the last block.
    for (const Param* p : stages[1]) EXPECT_EQ(p->name().rfind("decoder.layers.2.", 0), 0u);
    for (const Param* p : stages[3]) EXPECT_EQ(p->name().rfind("decoder.layers.0.", 0), 0u);

    std::vector<int> fired;
    m.set_grad_ready_hook([&](int s) { fired.push_back(s); });
    std::vector<int32_t> ids(16), targets(16);
    for (int i = 0; i < 16; ++i) {
      ids[i] = i % 64;
      targets[i] = (i * 7) % 64;
    }
    m.forward(ids.data(), targets.data());
    m.backward(1.0);
    EXPECT_EQ(fired, (std::vector<int>{0, 1, 2, 3, 4}));
  }
}

// Buckets tile each kind's flat buffer exactly, in launch order by ready stage.
void expect_tiling(const GradBuckets& b, const ParamRegistry& params) {
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const GradBucket& bk : b.buckets()) {
      if (bk.kind == k) ranges.push_back({bk.offset, bk.count});
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t at = 0;
    for (auto [off, n] : ranges) {
      EXPECT_EQ(off, at);
      at += n;
    }
    EXPECT_EQ(at, params.numel(k));
  }
  for (size_t i = 1; i < b.buckets().size(); ++i) {
    EXPECT_LE(b.buckets()[i - 1].ready_stage, b.buckets()[i].ready_stage);
  }
}

TEST(GradBuckets, OnePerStageByDefault) {
  cli::TrainFlags f = tiny_flags(true);
  model::GPTModel<float> m(f.model, 2, 7);
  GradBuckets b(m.params(), m.grad_stages(), nullptr, nullptr, GradReduceConfig{});
  expect_tiling(b, m.params());
  // Dense: head + final norm, three blocks, embedding; expert: the two MoE layers.
  int dense = 0, expert = 0;
  for (const GradBucket& bk : b.buckets()) {
    (bk.kind == ParamKind::Dense ? dense : expert)++;
    // Every parameter of a bucket belongs to its ready stage.
    for (const std::string& name : bk.params) {
      const auto& stage = m.grad_stages()[bk.ready_stage];
      EXPECT_TRUE(std::any_of(stage.begin(), stage.end(),
                              [&](const Param* p) { return p->name() == name; }))
          << name << " in a bucket of stage " << bk.ready_stage;
    }
  }
  EXPECT_EQ(dense, 5);
  EXPECT_EQ(expert, 2);
  EXPECT_EQ(b.buckets().front().ready_stage, 0);
  EXPECT_EQ(b.buckets().front().params,
            (std::vector<std::string>{"output_layer.weight", "decoder.final_layernorm.weight"}));
  EXPECT_FALSE(b.communicates());
}

TEST(GradBuckets, BySizeAcrossStages) {
  cli::TrainFlags f = tiny_flags(false);
  model::GPTModel<float> m(f.model, 2, 7);
  GradReduceConfig big;
  big.bucket_size = int64_t{1} << 40;
  GradBuckets one(m.params(), m.grad_stages(), nullptr, nullptr, big);
  expect_tiling(one, m.params());
  ASSERT_EQ(one.buckets().size(), 2u);  // one dense, one expert
  EXPECT_EQ(one.buckets()[0].ready_stage, 3);  // the expert bucket completes with layer 0
  EXPECT_EQ(one.buckets()[1].ready_stage, 4);  // the dense one with the (tied) embedding

  GradReduceConfig small;
  small.bucket_size = 300;
  GradBuckets many(m.params(), m.grad_stages(), nullptr, nullptr, small);
  expect_tiling(many, m.params());
  EXPECT_GT(many.buckets().size(), 7u);
  // Full buckets except each kind's last one.
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    std::vector<int64_t> counts;
    for (const GradBucket& bk : many.buckets()) {
      if (bk.kind == k) counts.push_back(bk.count);
    }
    for (size_t i = 0; i + 1 < counts.size(); ++i) EXPECT_GE(counts[i], 300);
  }
  GradReduceConfig bad;
  bad.bucket_size = -1;
  EXPECT_THROW(GradBuckets(m.params(), m.grad_stages(), nullptr, nullptr, bad), Error);
}

TEST(GradBuckets, GroupsOfOneDoNotCommunicate) {
  cli::TrainFlags f = tiny_flags(false);
  model::GPTModel<float> m(f.model, 2, 7);
  ParallelConfig cfg;
  // Not connected: a group of one must never touch its communicator (it would throw).
  ProcessGroups groups(make_layout(cfg, 1), 0);
  GradReduceConfig c;
  c.overlap = true;
  GradBuckets b(m.params(), m.grad_stages(), &groups.dp_cp(), &groups.expt_dp(), c);
  EXPECT_FALSE(b.communicates());
  b.arm();
  for (int s = 0; s < 5; ++s) b.stage_done(s);
  b.finish();
  EXPECT_EQ(b.launched_during_backward(), 0);
}

}  // namespace
}  // namespace moecore::parallel
