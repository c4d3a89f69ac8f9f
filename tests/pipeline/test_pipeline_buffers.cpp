// The pipeline runner's buffers as the planner counts them (pipeline_buffer_sizes): hand counts
// for 1F1B and interleaved stages, and the runner's own planned bytes equal to them for every
// rank of several layouts (built on sizing groups: the runner plans, nothing communicates); and
// the forwards the runner recomputes (recomputed_forwards) against hand-walked schedules.
#include <gtest/gtest.h>

#include <vector>

#include "common/tiny_model_config.h"
#include "model/gpt_model.h"
#include "parallel/pipeline_layout.h"
#include "parallel/process_groups.h"
#include "pipeline/pipeline_runner.h"
#include "pipeline/schedule.h"
#include "plan/sizing_groups.h"

namespace moecore::pipeline {
namespace {

// Chunks of one boundary size each; emb: which hold the embedding.
std::vector<ChunkBoundary> chunks(std::vector<bool> emb, int64_t elems, bool bf16 = false) {
  std::vector<ChunkBoundary> out;
  for (bool e : emb) out.push_back(ChunkBoundary{e, elems, elems, bf16 && !e, bf16});
  return out;
}

ScheduleConfig sched(int pp, int rank, int vp, int64_t m, int64_t g = 0) {
  ScheduleConfig c;
  c.pp = pp;
  c.rank = rank;
  c.vp = vp;
  c.num_microbatches = m;
  c.group_size = g;
  return c;
}

TEST(PipelineBuffers, NothingWithoutPipelining) {
  const PipelineBufferSizes s = pipeline_buffer_sizes(sched(1, 0, 1, 8), chunks({true}, 40), 100);
  EXPECT_EQ(s.stash_elems + s.grad_in_elems + s.send_elems + s.tied_elems, 0);
  EXPECT_EQ(s.bytes(4), 0);
}

TEST(PipelineBuffers, HandCounts1F1B) {
  // PP 2, M 4, one boundary activation of 10 floats (40 B: one 64-byte granule per slot).
  // Rank 0 holds the embedding: no stash; its 1F1B keeps pp - rank = 2 in flight, so each
  // send pool has 1 x 2 + 1 = 3 slots.
  const PipelineBufferSizes r0 = pipeline_buffer_sizes(sched(2, 0, 1, 4), chunks({true}, 10), 0);
  EXPECT_EQ(r0.stash_elems, 0);
  EXPECT_EQ(r0.grad_in_elems, 10);
  EXPECT_EQ(r0.send_slots_per_pool, 3);
  EXPECT_EQ(r0.send_elems, 60);
  EXPECT_EQ(r0.tied_elems, 0);
  EXPECT_EQ(r0.bytes(4), 64 + 6 * 64);
  // Rank 1 (the last): one in flight, one stash slot, pools of 2; the tied table's 100 floats
  // (400 B -> 448 B).
  const PipelineBufferSizes r1 = pipeline_buffer_sizes(sched(2, 1, 1, 4), chunks({false}, 10), 100);
  EXPECT_EQ(r1.stash_slots, std::vector<int64_t>{1});
  EXPECT_EQ(r1.stash_elems, 10);
  EXPECT_EQ(r1.send_slots_per_pool, 2);
  EXPECT_EQ(r1.tied_elems, 100);
  EXPECT_EQ(r1.bytes(4), 64 + 64 + 4 * 64 + 448);
  // f64: 80 B per slot -> 128 B.
  EXPECT_EQ(r1.bytes(8), 128 + 128 + 4 * 128 + 832);
}

TEST(PipelineBuffers, HandCountsInterleaved) {
  // PP 2, VP 2, M 4 (groups of 2), rank 0: warmup (2 - 0 - 1) x 2 + 1 x 2 = 4 forwards
  // F0.0 F1.0 F0.1 F1.1, then F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0, then B2.1 B3.1 B2.0 B3.0:
  // chunk 0 keeps 4 in flight (F0..F3 before B0.0) but holds the embedding, chunk 1 keeps 2.
  const PipelineBufferSizes s = pipeline_buffer_sizes(sched(2, 0, 2, 4), chunks({true, false}, 10), 0);
  EXPECT_EQ(s.stash_slots, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(s.stash_elems, 20);
  EXPECT_EQ(s.send_slots_per_pool, 2 * 4 + 1);
  EXPECT_EQ(s.bytes(4), (2 + 1 + 2 * 9) * 64);
}

TEST(PipelineBuffers, HandCountsReceivedAhead) {
  // PP 2, VP 2, M 4 in groups of 4, rank 0: F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 B0.1 F3.1 ...
  // keeps 3 of chunk 1 in flight, and receives micro-batch 3's activation before B0.1's gradient
  // (rank 1 sends them in that order): 4 stash slots of chunk 1, one gradient slot.
  const PipelineBufferSizes s =
      pipeline_buffer_sizes(sched(2, 0, 2, 4, 4), chunks({true, false}, 10), 0);
  EXPECT_EQ(s.stash_slots, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(s.grad_in_slots, 1);
  // M 8 in groups of 4, rank 1: three gradients held at once, each received in the round rank 0
  // sends it (G0.0, G1.0, G2.0 before rank 1's B0.0: the lockstep exchanges), and chunk 0's
  // stash: 5 slots.
  const PipelineBufferSizes r1 =
      pipeline_buffer_sizes(sched(2, 1, 2, 8, 4), chunks({false, false}, 10), 0);
  EXPECT_EQ(r1.stash_slots, (std::vector<int64_t>{5, 1}));
  EXPECT_EQ(r1.grad_in_slots, 3);
  EXPECT_EQ(r1.bytes(4), (5 + 1 + 3 + 2 * r1.send_slots_per_pool) * 64);
}

TEST(PipelineBuffers, RecomputedForwards) {
  // No pipelining and forward-only: never.
  EXPECT_EQ(recomputed_forwards(sched(1, 0, 1, 8)), 0);
  ScheduleConfig eval = sched(2, 0, 1, 8);
  eval.forward_only = true;
  EXPECT_EQ(recomputed_forwards(eval), 0);
  // 1F1B, PP 2, M 4: rank 0 runs F0 | F1 B0 F2 B1 F3 B2 | B3: every backward after another
  // forward or a backward; the last rank runs F B F B ...: none.
  EXPECT_EQ(recomputed_forwards(sched(2, 0, 1, 4)), 4);
  EXPECT_EQ(recomputed_forwards(sched(2, 1, 1, 4)), 0);
  // PP 4, M 2, rank 0: warmup min(3, 2) = 2: F0 F1 B0 B1: both.
  EXPECT_EQ(recomputed_forwards(sched(4, 0, 1, 2)), 2);
  // Interleaved PP 2, VP 2, M 4, rank 1: warmup 2: F0.0 F1.0 | F0.1 B0.1 F1.1 B1.1 F2.0 B0.0
  // F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 | B2.0 B3.0: chunk 1's backwards follow their forwards,
  // chunk 0's do not: 4.
  EXPECT_EQ(recomputed_forwards(sched(2, 1, 2, 4)), 4);
  // Rank 0 of the same (the walk in HandCountsInterleaved): all 8.
  EXPECT_EQ(recomputed_forwards(sched(2, 0, 2, 4)), 8);
}

ModelConfig tiny(bool tied, int64_t layers) {
  ModelConfig cfg = testing::tiny_moe_config(layers);
  cfg.moe_layer_pattern.assign(layers, 1);
  cfg.tie_embeddings = tied;
  return cfg;
}

// Every pp rank's runner plans exactly pipeline_buffer_sizes(...).bytes(); under --bf16 (the
// bf16 residual stream) with the kept inputs in bf16.
TEST(PipelineBuffers, RunnerPlansTheCounts) {
  struct Case {
    int pp, vp;
    int64_t layers, m, group;
    bool tied;
    bool bf16 = false;
  };
  for (const Case& k : {Case{2, 1, 2, 4, 0, true}, Case{2, 1, 4, 3, 0, false},
                        Case{4, 1, 4, 8, 0, true}, Case{2, 2, 4, 4, 0, true},
                        Case{2, 2, 8, 5, 3, false}, Case{4, 2, 8, 8, 0, true},
                        Case{2, 2, 4, 8, 4, true}, Case{2, 1, 2, 4, 0, true, true},
                        Case{4, 2, 8, 8, 0, false, true}}) {
    parallel::ParallelConfig pc;
    pc.pp = k.pp;
    pc.vp_stages = k.vp > 1 ? k.vp : 0;
    pc.microbatch_group_size = static_cast<int>(k.group);
    ModelConfig cfg = tiny(k.tied, k.layers);
    cfg.bf16 = k.bf16;
    const parallel::PipelineLayout pl = parallel::pipeline_layout(pc, k.layers);
    const parallel::Layout layout = parallel::make_layout(pc, k.pp);
    for (int r = 0; r < k.pp; ++r) {
      SCOPED_TRACE(::testing::Message() << "pp " << k.pp << " vp " << k.vp << " M " << k.m
                                        << " tied " << k.tied << " bf16 " << k.bf16 << " rank "
                                        << r);
      const auto groups = plan::sizing_groups(layout, r);
      const int stage = groups->pp_stage();
      std::vector<parallel::VirtualStage> stages;
      std::vector<bool> emb;
      for (int c = 0; c < pl.vp; ++c) {
        stages.push_back(pl.stage(stage, c));
        emb.push_back(stages.back().embedding);
      }
      model::GPTModel<float> model(cfg, /*micro_batch=*/2, /*seed=*/1, groups.get(),
                                   /*size_only=*/true, cpu_exec(), stages);
      const PipelineRunner<float> runner(model, groups.get(), k.m, k.group, cpu_exec());
      const Param* table = model.tied_table();
      const PipelineBufferSizes s = pipeline_buffer_sizes(
          runner.schedule_config(), chunks(emb, model.boundary_elems(), k.bf16),
          table != nullptr ? table->local_numel() : 0);
      EXPECT_EQ(static_cast<int64_t>(runner.planned_bytes()), s.bytes(sizeof(float)));
      EXPECT_GT(s.bytes(sizeof(float)), 0);
      // Under --bf16 every kept input is bf16.
      for (size_t c = 0; c < s.stash_slots.size(); ++c)
        EXPECT_EQ(s.input_bf16[c], k.bf16 && s.stash_slots[c] > 0) << "chunk " << c;
      EXPECT_EQ(s.tied_elems > 0, k.tied && (stage == 0 || stage == k.pp - 1));
    }
  }
}

}  // namespace
}  // namespace moecore::pipeline
