// The pipeline schedules against Megatron-Core: its published table (PP 2, group 3, M 5, VP 2),
// its test_get_pipeline_parallel_order, the properties every schedule must have over a grid of
// layouts, a simulation of all ranks together (no deadlock), and one test per error.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "pipeline/schedule.h"

namespace moecore::pipeline {
namespace {

std::string error_of(const ScheduleConfig& c) {
  try {
    validate_schedule(c);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool valid(const ScheduleConfig& c) { return error_of(c).empty(); }

// Megatron's convert_schedule_table_to_order encoding: forward of chunk c is c + 1, backward -(c + 1).
std::vector<int> order_of(const std::vector<Work>& s) {
  std::vector<int> out;
  for (const Work& w : s) out.push_back(w.pass == Pass::Forward ? w.chunk + 1 : -(w.chunk + 1));
  return out;
}

TEST(PipelineSchedule, MegatronPublishedTable) {
  // schedules.py: "the tunable schedule table for PP2 N3M5 with VP2".
  const auto table = schedule_table(5, 2, 3);
  std::vector<int64_t> mbs;
  std::vector<int> chunks;
  for (const auto& [mb, chunk] : table) {
    mbs.push_back(mb);
    chunks.push_back(chunk);
  }
  EXPECT_EQ(mbs, (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 3, 4, 3, 4}));
  EXPECT_EQ(chunks, (std::vector<int>{0, 0, 0, 1, 1, 1, 0, 0, 1, 1}));
  // cuda_graphs.py's convert_schedule_table_to_order docstring: that table with 5 warmup
  // forwards (rank 0: (2 - 0 - 1) * 2 + (2 - 1) * 3).
  const ScheduleConfig c{.pp = 2, .rank = 0, .vp = 2, .num_microbatches = 5, .group_size = 3};
  EXPECT_EQ(warmup_forwards(c), 5);
  EXPECT_EQ(order_of(schedule(c)),
            (std::vector<int>{1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1}));
  EXPECT_EQ(format_schedule(c),
            "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 B0.1 F3.0 B1.1 F4.0 B2.1 F3.1 B0.0 F4.1 B1.0 B2.0 "
            "B3.1 B4.1 B3.0 B4.0");
  // The help text of the flag: PP 2, VP 2, group 2, M 4 runs micro-batches 0 1 0 1 2 3 2 3.
  std::vector<int64_t> g2;
  for (const auto& [mb, chunk] : schedule_table(4, 2, 2)) g2.push_back(mb);
  EXPECT_EQ(g2, (std::vector<int64_t>{0, 1, 0, 1, 2, 3, 2, 3}));
}

TEST(PipelineSchedule, NoPipeliningAndOneFOneB) {
  EXPECT_EQ(format_schedule({.pp = 1, .num_microbatches = 3}), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0");
  // 1F1B, PP 4: rank 1 runs pp - rank - 1 = 2 forwards ahead, the last rank none.
  EXPECT_EQ(format_schedule({.pp = 4, .rank = 1, .num_microbatches = 6}),
            "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 B4.0 B5.0");
  EXPECT_EQ(format_schedule({.pp = 4, .rank = 3, .num_microbatches = 2}), "F0.0 B0.0 F1.0 B1.0");
  // Fewer micro-batches than warmup: all forwards first (capped at M).
  EXPECT_EQ(format_schedule({.pp = 4, .rank = 0, .num_microbatches = 2}), "F0.0 F1.0 B0.0 B1.0");
  EXPECT_EQ(format_schedule({.pp = 2, .rank = 0, .vp = 1, .num_microbatches = 3, .forward_only = true}),
            "F0.0 F1.0 F2.0");
}

// Megatron's tests/unit_tests/pipeline_parallel/test_schedules.py::test_get_pipeline_parallel_order,
// its parameters and assertions on the chunk order, for every rank. Interleaved cases Megatron's
// schedule itself refuses (group size outside [pp, M]) must be refused here too.
TEST(PipelineSchedule, MegatronGetPipelineParallelOrder) {
  const std::vector<std::pair<int, int>> pp_group = {{1, 1}, {2, 2}, {2, 4}, {4, 4},
                                                     {4, 5}, {8, 9}, {8, 11}};
  int checked = 0, refused = 0;
  for (const auto& [pp, g] : pp_group) {
    for (int64_t m : {8, 32}) {
      for (int vp : {1, 2, 4, 8}) {
        if (pp == 1 && vp > 1) continue;
        for (int rank = 0; rank < pp; ++rank) {
          const ScheduleConfig c{.pp = pp, .rank = rank, .vp = vp, .num_microbatches = m,
                                 .group_size = g};
          SCOPED_TRACE(testing::Message() << "pp " << pp << " vp " << vp << " M " << m << " G "
                                          << g << " rank " << rank);
          if (vp > 1 && (g < pp || g > m || (m % g != 0 && m % g < pp))) {
            EXPECT_FALSE(valid(c));
            ++refused;
            continue;
          }
          const std::vector<int> order = order_of(schedule(c));
          ASSERT_EQ(*std::max_element(order.begin(), order.end()), vp);
          ASSERT_EQ(static_cast<int64_t>(order.size()), m * vp * 2);
          std::map<int, int> cnt;
          int64_t acc = 0;
          for (int o : order) {
            ++cnt[o];
            if (o < 0) {
              ASSERT_TRUE(cnt.count(-o) && cnt[-o] >= cnt[o]);
            } else if (cnt.count(-o)) {
              ASSERT_LT(cnt[-o], cnt[o]);
            }
            acc += o;
            ASSERT_GE(acc, 0);
          }
          EXPECT_EQ(acc, 0);
          EXPECT_FALSE(cnt.count(0));
          for (const auto& [k, v] : cnt) EXPECT_EQ(cnt[-k], v);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(refused, 0);
}

struct Grid {
  int pp, vp;
  int64_t m;
};
std::vector<Grid> grid() {
  std::vector<Grid> out;
  for (int pp : {1, 2, 4, 8}) {
    for (int vp : {1, 2, 4}) {
      for (int64_t m : {8, 32}) {
        if (valid({.pp = pp, .rank = 0, .vp = vp, .num_microbatches = m})) out.push_back({pp, vp, m});
      }
    }
  }
  return out;
}

TEST(PipelineSchedule, EveryPassOnceInOrderWithWarmupAndMemoryAsMegatron) {
  const std::vector<Grid> cases = grid();
  EXPECT_EQ(cases.size(), 20u);  // PP 1 with VP 1 only: 2 + 3 x 6
  for (const Grid& gr : cases) {
    std::vector<std::vector<std::vector<int64_t>>> forward_mbs(gr.pp);
    for (int rank = 0; rank < gr.pp; ++rank) {
      const ScheduleConfig c{.pp = gr.pp, .rank = rank, .vp = gr.vp, .num_microbatches = gr.m};
      SCOPED_TRACE(format_schedule(c));
      const std::vector<Work> s = schedule(c);
      ASSERT_EQ(static_cast<int64_t>(s.size()), 2 * gr.m * gr.vp);
      std::set<std::pair<int64_t, int>> fwd, bwd;
      forward_mbs[rank].assign(gr.vp, {});
      std::vector<std::vector<int64_t>> backward_mbs(gr.vp);
      for (const Work& w : s) {
        const auto key = std::pair{w.microbatch, w.chunk};
        ASSERT_TRUE(w.microbatch >= 0 && w.microbatch < gr.m && w.chunk >= 0 && w.chunk < gr.vp);
        if (w.pass == Pass::Forward) {
          ASSERT_TRUE(fwd.insert(key).second) << "forward twice";
          forward_mbs[rank][w.chunk].push_back(w.microbatch);
        } else {
          ASSERT_TRUE(fwd.count(key)) << "backward before its forward";
          ASSERT_TRUE(bwd.insert(key).second) << "backward twice";
          backward_mbs[w.chunk].push_back(w.microbatch);
        }
      }
      EXPECT_EQ(static_cast<int64_t>(fwd.size()), gr.m * gr.vp);
      EXPECT_EQ(static_cast<int64_t>(bwd.size()), gr.m * gr.vp);
      // Warmup as Megatron's get_pp_rank_microbatches.
      const int64_t total = gr.m * gr.vp;
      const int64_t want = gr.pp == 1   ? 0
                           : gr.vp == 1 ? std::min<int64_t>(gr.pp - rank - 1, gr.m)
                                        : std::min<int64_t>((gr.pp - rank - 1) * 2 +
                                                                (gr.vp - 1) * int64_t{gr.pp},
                                                            total);
      EXPECT_EQ(warmup_forwards(c), want);
      int64_t leading = 0;
      while (leading < static_cast<int64_t>(s.size()) && s[leading].pass == Pass::Forward) ++leading;
      EXPECT_EQ(leading, want == total ? total : want + 1) << "forwards before the first backward";
      // Each chunk sees its micro-batches in order, forward and backward.
      for (int ch = 0; ch < gr.vp; ++ch) {
        EXPECT_TRUE(std::is_sorted(forward_mbs[rank][ch].begin(), forward_mbs[rank][ch].end()));
        EXPECT_TRUE(std::is_sorted(backward_mbs[ch].begin(), backward_mbs[ch].end()));
      }
      // The memory a stage keeps: brute force, prefix by prefix.
      std::vector<int64_t> most(gr.vp, 0);
      for (size_t end = 1; end <= s.size(); ++end) {
        for (int ch = 0; ch < gr.vp; ++ch) {
          int64_t open = 0;
          for (size_t k = 0; k < end; ++k) {
            if (s[k].chunk == ch) open += s[k].pass == Pass::Forward ? 1 : -1;
          }
          most[ch] = std::max(most[ch], open);
        }
      }
      EXPECT_EQ(in_flight_per_chunk(c), most);
      if (gr.vp == 1) {
        EXPECT_EQ(most[0], std::min<int64_t>(gr.pp - rank, gr.m));
      }
    }
    // Consecutive ranks run a chunk's forwards in the same micro-batch order.
    for (int rank = 1; rank < gr.pp; ++rank) EXPECT_EQ(forward_mbs[rank], forward_mbs[rank - 1]);
  }
}

// All ranks at once: each runs its schedule in order, blocking on its next item until the data
// it needs exists (forward of (mb, virtual stage i) needs forward of (mb, i - 1); backward needs
// its own forward and the backward of (mb, i + 1)). Every schedule must finish.
void simulate(int pp, int vp, int64_t m, int64_t g) {
  const int stages = pp * vp;
  std::vector<std::vector<Work>> order(pp);
  for (int r = 0; r < pp; ++r) {
    order[r] = schedule({.pp = pp, .rank = r, .vp = vp, .num_microbatches = m, .group_size = g});
  }
  std::vector<size_t> next(pp, 0);
  std::set<std::tuple<int, int64_t, int>> done;  // (pass, mb, virtual stage)
  const auto has = [&](Pass p, int64_t mb, int stage) {
    return done.count({static_cast<int>(p), mb, stage}) > 0;
  };
  size_t remaining = 0;
  for (const auto& o : order) remaining += o.size();
  int64_t rounds = 0;
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < pp; ++r) {
      if (next[r] == order[r].size()) continue;
      const Work& w = order[r][next[r]];
      const int stage = w.chunk * pp + r;
      const bool ready = w.pass == Pass::Forward
                             ? stage == 0 || has(Pass::Forward, w.microbatch, stage - 1)
                             : has(Pass::Forward, w.microbatch, stage) &&
                                   (stage == stages - 1 || has(Pass::Backward, w.microbatch, stage + 1));
      if (!ready) continue;
      done.insert({static_cast<int>(w.pass), w.microbatch, stage});
      ++next[r];
      --remaining;
      progress = true;
    }
    ASSERT_TRUE(progress) << "deadlock after " << rounds << " rounds: pp " << pp << " vp " << vp
                          << " M " << m << " G " << g;
    ++rounds;
  }
  EXPECT_EQ(done.size(), static_cast<size_t>(2 * m * stages));
}

TEST(PipelineSchedule, AllRanksTogetherNeverDeadlock) {
  for (const Grid& gr : grid()) simulate(gr.pp, gr.vp, gr.m, 0);
  // Other group sizes, a last group that is not whole included.
  simulate(2, 2, 5, 3);
  simulate(4, 2, 10, 6);
  simulate(4, 4, 29, 5);
  simulate(8, 2, 32, 11);
}

// NCCL pairs a neighbour's messages with the receives in posting order: every rank must post the
// receives from each sender in the order that sender posts its sends (recv_plan), and each step
// must read its own message from the slot the plan gives it, never one overwritten while held.
void check_recv_plans(const ScheduleConfig& base) {
  for (int rank = 0; rank < base.pp; ++rank) {
    ScheduleConfig c = base;
    c.rank = rank;
    SCOPED_TRACE(testing::Message() << "pp " << c.pp << " vp " << c.vp << " M " << c.num_microbatches
                                    << " G " << c.group_size << " rank " << rank
                                    << (c.forward_only ? " forward-only" : ""));
    const std::vector<Work> order = schedule(c);
    const RecvPlan p = recv_plan(c);
    ASSERT_EQ(p.first.size(), order.size() + 1);
    std::map<int, std::vector<Message>> from;
    for (const RecvPost& r : p.posts) from[r.peer].push_back(r.msg);
    for (int peer = 0; peer < c.pp; ++peer) {
      if (peer == rank) continue;
      EXPECT_EQ(from[peer], messages_sent(c, peer, rank)) << "from pp rank " << peer;
    }
    // The slots' contents over the schedule: (gradient?, chunk, slot) -> the message held.
    std::map<std::tuple<bool, int, int>, Message> held;
    for (size_t i = 0; i < order.size(); ++i) {
      for (size_t k = p.first[i]; k < p.first[i + 1]; ++k) {
        const RecvPost& r = p.posts[k];
        const auto key = std::make_tuple(r.msg.gradient, r.msg.gradient ? 0 : r.msg.chunk, r.slot);
        EXPECT_EQ(held.count(key), 0u) << "a slot overwritten while held, step " << i;
        held[key] = r.msg;
        EXPECT_LT(r.slot, r.msg.gradient ? p.grad_slots : p.stash_slots[r.msg.chunk]);
      }
      const Work& w = order[i];
      const bool first_stage = rank == 0 && w.chunk == 0;
      const bool last_stage = rank == c.pp - 1 && w.chunk == c.vp - 1;
      if (c.pp > 1 && !first_stage) {
        const auto key = std::make_tuple(false, w.chunk, p.input_slot[i]);
        ASSERT_EQ(held.count(key), 1u) << "step " << i;
        EXPECT_EQ(held[key], (Message{false, w.microbatch, w.chunk})) << "step " << i;
        if (w.pass == Pass::Backward || c.forward_only) held.erase(key);
      }
      if (c.pp > 1 && w.pass == Pass::Backward && !last_stage) {
        const auto key = std::make_tuple(true, 0, p.grad_slot[i]);
        ASSERT_EQ(held.count(key), 1u) << "step " << i;
        EXPECT_EQ(held[key], (Message{true, w.microbatch, w.chunk})) << "step " << i;
        held.erase(key);
      }
    }
    EXPECT_TRUE(held.empty());
    if (c.pp == 1) {
      EXPECT_TRUE(p.posts.empty());
    }
  }
}

TEST(PipelineSchedule, ReceivesPostedInTheSendersOrder) {
  for (const Grid& gr : grid()) {
    for (bool fo : {false, true})
      check_recv_plans({.pp = gr.pp, .vp = gr.vp, .num_microbatches = gr.m, .forward_only = fo});
  }
  for (int64_t m = 2; m <= 12; ++m) {
    for (int64_t g = 2; g <= m; ++g) {
      const ScheduleConfig c{.pp = 2, .vp = 2, .num_microbatches = m, .group_size = g};
      if (valid(c)) check_recv_plans(c);
    }
  }
  check_recv_plans({.pp = 2, .vp = 3, .num_microbatches = 7, .group_size = 4});
  check_recv_plans({.pp = 4, .vp = 2, .num_microbatches = 10, .group_size = 6});
  check_recv_plans({.pp = 4, .vp = 4, .num_microbatches = 29, .group_size = 5});
}

// 1F1B receives each message just before the step that reads it. The interleaved schedule
// receives each in the round its sender sends it (pipeline/lockstep.h): with PP 2 in groups of 4,
// rank 1 sends rank 0 the activation of micro-batch 3 for chunk 1 before the gradient of
// micro-batch 0, which rank 0 reads first; rank 0 receives the activations as they come, into a
// stash slot more than it keeps in flight.
TEST(PipelineSchedule, InterleavedReceivesInTheRoundOfTheSend) {
  const ScheduleConfig c{.pp = 2, .rank = 0, .vp = 2, .num_microbatches = 4, .group_size = 4};
  const std::vector<Message> sent = messages_sent(c, 1, 0);
  const auto at = [&](Message m) { return std::find(sent.begin(), sent.end(), m) - sent.begin(); };
  EXPECT_LT(at({false, 3, 1}), at({true, 0, 1}));
  EXPECT_EQ(format_schedule(c),
            "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0");
  const RecvPlan p = recv_plan(c);
  // Round by round: rank 1 runs F0.0 F1.0 F0.1 ... one round behind rank 0, so A0.1 comes
  // before F2.0, A3.1 before F1.1, and G0.1 (rank 1's B0.1 after its F0.1) before F2.1.
  EXPECT_EQ(p.first[2], 0u);
  EXPECT_EQ(p.posts[p.first[2]].msg, (Message{false, 0, 1}));
  ASSERT_EQ(p.first[6] - p.first[5], 1u);
  EXPECT_EQ(p.posts[p.first[5]].msg, (Message{false, 3, 1}));
  ASSERT_EQ(p.first[7] - p.first[6], 1u);
  EXPECT_EQ(p.posts[p.first[6]].msg, (Message{true, 0, 1}));
  EXPECT_EQ(p.first[8], p.first[7]);  // nothing more before B0.1
  // F2.1 and B0.1 are one iteration: their outputs go out together, before F3.1.
  const auto before_f31 = std::find_if(p.exchanges.begin(), p.exchanges.end(),
                                       [](const Exchange& e) { return e.before == 8; });
  ASSERT_NE(before_f31, p.exchanges.end());
  EXPECT_EQ(before_f31->sends, (std::vector<size_t>{6, 7}));
  EXPECT_EQ(in_flight_per_chunk(c), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(p.stash_slots, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(p.grad_slots, 1);
  // PP 2 x VP 2 x M 8 in groups of 4: rank 0 sends rank 1 the gradients G0.0, G1.0, G2.0 in the
  // rounds before rank 1's F2.1, F3.1 and F4.0, which reads the first in B0.0 after F4.0: three
  // held at once.
  EXPECT_EQ(recv_plan({.pp = 2, .rank = 1, .vp = 2, .num_microbatches = 8, .group_size = 4})
                .grad_slots,
            3);
  for (const ScheduleConfig& d : {ScheduleConfig{.pp = 2, .rank = 0, .vp = 2, .num_microbatches = 8},
                                  ScheduleConfig{.pp = 4, .rank = 2, .vp = 2, .num_microbatches = 8,
                                                 .group_size = 8},
                                  ScheduleConfig{.pp = 2, .rank = 1, .vp = 1, .num_microbatches = 8}}) {
    const RecvPlan q = recv_plan(d);
    if (d.vp == 1) {
      // Each step receives what it reads, nothing ahead; no exchanges.
      for (size_t i = 0; i + 1 < q.first.size(); ++i) EXPECT_LE(q.first[i + 1] - q.first[i], 1u);
      EXPECT_TRUE(q.exchanges.empty());
    }
    // Each round receives at most the previous rank's activation and then the next rank's
    // gradient, and sends at most one iteration's outputs (a forward's, then a backward's).
    for (const Exchange& e : q.exchanges) {
      ASSERT_LE(e.end_post - e.first_post, 2u);
      if (e.end_post - e.first_post == 2) {
        EXPECT_FALSE(q.posts[e.first_post].msg.gradient);
        EXPECT_TRUE(q.posts[e.first_post + 1].msg.gradient);
      }
      EXPECT_LE(e.sends.size(), 2u);
    }
    EXPECT_EQ(q.grad_slots, d.rank == d.pp - 1 && d.vp == 1 ? 0 : 1);
  }
}

TEST(PipelineSchedule, ForwardOnlyRunsTheTableInOrder) {
  const ScheduleConfig c{.pp = 2, .rank = 1, .vp = 2, .num_microbatches = 5, .group_size = 3,
                         .forward_only = true};
  EXPECT_EQ(warmup_forwards(c), 10);
  EXPECT_EQ(format_schedule(c), "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 F3.0 F4.0 F3.1 F4.1");
  EXPECT_EQ(in_flight_per_chunk(c), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(format_schedule({.pp = 1, .num_microbatches = 2, .forward_only = true}), "F0.0 F1.0");
}

TEST(PipelineSchedule, ErrorsNameTheFlags) {
  const auto expect = [](const ScheduleConfig& c, std::vector<std::string> parts) {
    const std::string msg = error_of(c);
    ASSERT_FALSE(msg.empty());
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
  };
  const std::string g = "--microbatch-group-size-per-virtual-pipeline-stage";
  // Group below pp, above M; M < pp with the default group.
  expect({.pp = 4, .vp = 2, .num_microbatches = 8, .group_size = 3}, {g, "[4, 8]"});
  expect({.pp = 2, .vp = 2, .num_microbatches = 4, .group_size = 5}, {g, "[2, 4]"});
  expect({.pp = 4, .vp = 2, .num_microbatches = 2}, {"--global-batch-size", "[4, 2]"});
  // A last group smaller than pp: 9 = 4 + 4 + 1.
  expect({.pp = 4, .vp = 2, .num_microbatches = 9, .group_size = 4}, {g, "last group of 1"});
  expect({.pp = 1, .vp = 2, .num_microbatches = 4}, {"--pipeline-model-parallel-size"});
  expect({.pp = 2, .rank = 2, .num_microbatches = 4}, {"pipeline rank 2"});
  expect({.pp = 2, .num_microbatches = 0}, {"--micro-batch-size"});
  EXPECT_THROW(schedule({.pp = 4, .vp = 2, .num_microbatches = 9, .group_size = 4}), Error);
  // Without virtual stages the group size changes nothing (Megatron ignores it).
  EXPECT_TRUE(valid({.pp = 4, .num_microbatches = 2, .group_size = 3}));
  // A remainder of at least pp is fine: 10 = 6 + 4 with pp 4.
  EXPECT_TRUE(valid({.pp = 4, .vp = 2, .num_microbatches = 10, .group_size = 6}));
}

}  // namespace
}  // namespace moecore::pipeline
