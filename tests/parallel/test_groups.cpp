// Process groups without processes: the worked examples of MOE_SEMANTICS exactly,
// --use-tp-pp-dp-mapping, context parallelism, partition properties over every layout of small
// worlds, and one test per validation message.
#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>
#include <string>

#include "core/check.h"
#include "parallel/process_groups.h"
#include "parallel/rank_generator.h"

namespace moecore::parallel {
namespace {

RankLists singletons(int n) {
  RankLists out;
  for (int r = 0; r < n; ++r) out.push_back({r});
  return out;
}

RankLists contiguous(int n, int size) {
  RankLists out(n / size);
  for (int r = 0; r < n; ++r) out[r / size].push_back(r);
  return out;
}

ParallelConfig cfg(int tp, int pp, int cp, int ep, int etp) {
  ParallelConfig c;
  c.tp = tp;
  c.pp = pp;
  c.cp = cp;
  c.ep = ep;
  c.etp = etp;
  return c;
}

// MOE_SEMANTICS: W=16, TP=2, PP=2, CP=1 (DP=4), ETP=1, EP=4 (EDP=2).
TEST(ProcessGroups, WorkedExampleEtp1Ep4) {
  const Layout l = make_layout(cfg(2, 2, 1, 4, 1), 16);
  EXPECT_EQ(l.degrees.dp, 4);
  EXPECT_EQ(l.degrees.edp, 2);
  EXPECT_EQ(l.of(GroupKind::Tp), contiguous(16, 2));
  EXPECT_EQ(l.of(GroupKind::Dp),
            (RankLists{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(l.of(GroupKind::Pp), (RankLists{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13},
                                            {6, 14}, {7, 15}}));
  EXPECT_EQ(l.of(GroupKind::Ep), contiguous(16, 4));
  EXPECT_EQ(l.of(GroupKind::ExptTp), singletons(16));
  EXPECT_EQ(l.of(GroupKind::ExptDp), (RankLists{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13},
                                                {10, 14}, {11, 15}}));
  EXPECT_EQ(l.of(GroupKind::TpEp), l.of(GroupKind::Ep));
  // The derived groups that follow from the same grids.
  EXPECT_EQ(l.of(GroupKind::Cp), singletons(16));
  EXPECT_EQ(l.of(GroupKind::DpCp), l.of(GroupKind::Dp));
  EXPECT_EQ(l.of(GroupKind::TpCp), l.of(GroupKind::Tp));
  EXPECT_EQ(l.of(GroupKind::TpDpCp), contiguous(16, 8));
  EXPECT_EQ(l.of(GroupKind::TpEpPp),
            (RankLists{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  // Rank 5 holds experts [ep_rank * L, ...): its EP position is 1.
  ProcessGroups g(l, 5);
  EXPECT_EQ(g.ep().ranks, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(g.ep_rank(), 1);
  EXPECT_EQ(g.pp_stage(), 0);
  EXPECT_EQ(g.expt_dp().ranks, (std::vector<int>{1, 5}));
  EXPECT_EQ(g.expt_dp().rank, 1);
  EXPECT_EQ(ProcessGroups(l, 13).pp_stage(), 1);
}

// MOE_SEMANTICS: the same with ETP=2, EP=4 (EDP=1).
TEST(ProcessGroups, WorkedExampleEtp2Ep4) {
  const Layout l = make_layout(cfg(2, 2, 1, 4, 2), 16);
  EXPECT_EQ(l.degrees.edp, 1);
  EXPECT_EQ(l.of(GroupKind::ExptTp), contiguous(16, 2));
  EXPECT_EQ(l.of(GroupKind::Ep),
            (RankLists{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(l.of(GroupKind::TpEp), contiguous(16, 8));
  EXPECT_EQ(l.of(GroupKind::ExptDp), singletons(16));
  EXPECT_EQ(l.of(GroupKind::TpEpPp), contiguous(16, 16));
  // The attention grid does not change with the expert degrees.
  EXPECT_EQ(l.of(GroupKind::Tp), contiguous(16, 2));
  EXPECT_EQ(l.of(GroupKind::Pp), make_layout(cfg(2, 2, 1, 4, 1), 16).of(GroupKind::Pp));
}

TEST(ProcessGroups, ExpertTpDefaultsToTp) {
  const Layout l = make_layout(cfg(2, 1, 1, 2, 0), 8);
  EXPECT_EQ(l.degrees.etp, 2);
  EXPECT_EQ(l.of(GroupKind::ExptTp), l.of(GroupKind::Tp));
}

// --use-tp-pp-dp-mapping: order tp-cp-ep-pp-dp, so pp neighbours are closer than dp ones.
TEST(ProcessGroups, TpPpDpMapping) {
  ParallelConfig c = cfg(2, 2, 1, 2, 1);
  c.use_tp_pp_dp_mapping = true;
  EXPECT_EQ(c.order(), "tp-cp-ep-pp-dp");
  const Layout l = make_layout(c, 8);
  EXPECT_EQ(l.of(GroupKind::Tp), contiguous(8, 2));
  EXPECT_EQ(l.of(GroupKind::Pp), (RankLists{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.of(GroupKind::Dp), (RankLists{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.of(GroupKind::Ep), contiguous(8, 2));
  EXPECT_EQ(l.of(GroupKind::ExptDp), (RankLists{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.of(GroupKind::TpEpPp), (RankLists{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  // Default order for comparison: pp is the slowest digit.
  const Layout d = make_layout(cfg(2, 2, 1, 2, 1), 8);
  EXPECT_EQ(d.of(GroupKind::Pp), (RankLists{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(d.of(GroupKind::Dp), (RankLists{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
}

// CP=2 with TP=2 on 8 ranks; EP=4 folds over what attention uses as TP x CP.
TEST(ProcessGroups, ContextParallel) {
  const Layout l = make_layout(cfg(2, 1, 2, 4, 1), 8);
  EXPECT_EQ(l.degrees.dp, 2);
  EXPECT_EQ(l.degrees.edp, 2);
  EXPECT_EQ(l.of(GroupKind::Tp), contiguous(8, 2));
  EXPECT_EQ(l.of(GroupKind::Cp), (RankLists{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.of(GroupKind::Dp), (RankLists{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.of(GroupKind::DpCp), (RankLists{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(l.of(GroupKind::TpCp), contiguous(8, 4));
  EXPECT_EQ(l.of(GroupKind::TpDpCp), contiguous(8, 8));
  EXPECT_EQ(l.of(GroupKind::Ep), contiguous(8, 4));
  EXPECT_EQ(l.of(GroupKind::ExptDp), (RankLists{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.of(GroupKind::TpEp), l.of(GroupKind::Ep));
  EXPECT_EQ(l.of(GroupKind::Pp), singletons(8));
}

TEST(RankGenerator, OrderStrings) {
  // tp-dp order on 4 ranks with tp=2: tp adjacent, dp strided.
  RankGenerator g(2, 1, 1, 2, 1, "tp-dp");
  EXPECT_EQ(g.order(), "tp-dp-cp-ep-pp");  // size-1 dimensions appended
  EXPECT_EQ(g.ranks("tp"), (RankLists{{0, 1}, {2, 3}}));
  EXPECT_EQ(g.ranks("dp"), (RankLists{{0, 2}, {1, 3}}));
  // Swapping the order swaps the strides.
  RankGenerator h(2, 1, 1, 2, 1, "dp-tp");
  EXPECT_EQ(h.ranks("tp"), (RankLists{{0, 2}, {1, 3}}));
  // Members are listed in order-string order, whatever the order of the request.
  EXPECT_EQ(g.ranks("dp-tp"), g.ranks("tp-dp"));
}

void expect_error(const std::function<void()>& f, std::vector<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << parts[0] << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
  }
}

TEST(RankGenerator, BadOrders) {
  expect_error([] { RankGenerator(1, 1, 1, 1, 1, "tp-xx"); }, {"unknown dimension 'xx'"});
  expect_error([] { RankGenerator(1, 1, 1, 1, 1, "tp-tp"); }, {"repeats dimension 'tp'"});
  expect_error([] { RankGenerator(2, 1, 1, 2, 1, "tp"); }, {"lacks dimension 'dp'", "2"});
  expect_error([] { RankGenerator(1, 1, 1, 1, 1, "tp").ranks("tp-zz"); },
               {"unknown dimension 'zz'"});
}

// Every layout of every world up to 16: each kind partitions the world into equal groups of the
// expected size, and the composite groups contain their parts.
TEST(ProcessGroups, EveryLayoutPartitionsTheWorld) {
  int layouts = 0;
  for (int w = 1; w <= 16; ++w) {
    for (int tp = 1; tp <= w; ++tp)
      for (int cp = 1; cp <= w; ++cp)
        for (int pp = 1; pp <= w; ++pp)
          for (int ep = 1; ep <= w; ++ep)
            for (int etp = 1; etp <= w; ++etp)
              for (bool mapping : {false, true}) {
                if (w % (tp * cp * pp) || w % (etp * ep * pp)) continue;
                ParallelConfig c = cfg(tp, pp, cp, ep, etp);
                c.use_tp_pp_dp_mapping = mapping;
                if (mapping && pp > 1 && tp * cp != etp * ep) {
                  EXPECT_THROW(make_layout(c, w), Error);
                  continue;
                }
                const Layout l = make_layout(c, w);
                ++layouts;
                const Degrees& d = l.degrees;
                const std::vector<std::pair<GroupKind, int>> sizes = {
                    {GroupKind::Tp, tp},           {GroupKind::Cp, cp},
                    {GroupKind::Dp, d.dp},         {GroupKind::DpCp, d.dp * cp},
                    {GroupKind::TpCp, tp * cp},    {GroupKind::TpDpCp, tp * d.dp * cp},
                    {GroupKind::Pp, pp},           {GroupKind::Ep, ep},
                    {GroupKind::ExptTp, etp},      {GroupKind::ExptDp, d.edp},
                    {GroupKind::TpEp, etp * ep},   {GroupKind::TpEpPp, etp * ep * pp}};
                for (auto [k, size] : sizes) {
                  std::set<int> seen;
                  for (const auto& g : l.of(k)) {
                    ASSERT_EQ(static_cast<int>(g.size()), size) << group_name(k);
                    seen.insert(g.begin(), g.end());
                  }
                  ASSERT_EQ(static_cast<int>(seen.size()), w) << group_name(k);
                  ASSERT_EQ(static_cast<int>(l.of(k).size()) * size, w) << group_name(k);
                }
                for (int r = 0; r < w; ++r) {
                  auto members = [&](GroupKind k) {
                    const auto& g = l.of(k)[l.group_index(k, r)];
                    return std::set<int>(g.begin(), g.end());
                  };
                  auto contains = [&](GroupKind big, GroupKind small) {
                    auto b = members(big), s = members(small);
                    return std::includes(b.begin(), b.end(), s.begin(), s.end());
                  };
                  ASSERT_TRUE(contains(GroupKind::TpDpCp, GroupKind::Tp));
                  ASSERT_TRUE(contains(GroupKind::TpDpCp, GroupKind::DpCp));
                  ASSERT_TRUE(contains(GroupKind::DpCp, GroupKind::Cp));
                  ASSERT_TRUE(contains(GroupKind::TpCp, GroupKind::Tp));
                  ASSERT_TRUE(contains(GroupKind::TpEp, GroupKind::Ep));
                  ASSERT_TRUE(contains(GroupKind::TpEp, GroupKind::ExptTp));
                  ASSERT_TRUE(contains(GroupKind::TpEpPp, GroupKind::TpEp));
                  // Both grids span a pipeline stage with the same ranks.
                  auto stage_of = [&](int rank) { return l.position(GroupKind::Pp, rank); };
                  for (int m : members(GroupKind::TpDpCp)) ASSERT_EQ(stage_of(m), stage_of(r));
                  for (int m : members(GroupKind::ExptDp)) ASSERT_EQ(stage_of(m), stage_of(r));
                  for (int m : members(GroupKind::TpEp)) ASSERT_EQ(stage_of(m), stage_of(r));
                }
              }
  }
  EXPECT_GT(layouts, 300);
}

// ---- validation: one test per message ----

ModelDims dims(int64_t layers, int64_t experts) {
  ModelDims m;
  m.num_layers = layers;
  m.num_experts = experts;
  return m;
}

TEST(ParallelValidation, WorldNotDivisibleByAttentionGrid) {
  expect_error([] { validate_layout(cfg(8, 1, 1, 1, 0), 12, {}); },
               {"world size 12", "tp*cp*pp = 8*1*1 = 8", "--tensor-model-parallel-size"});
  expect_error([] { validate_layout(cfg(1, 2, 3, 1, 0), 8, {}); }, {"1*3*2 = 6"});
}

TEST(ParallelValidation, WorldNotDivisibleByExpertGrid) {
  expect_error([] { validate_layout(cfg(1, 2, 1, 3, 1), 8, dims(4, 6)); },
               {"world size 8", "etp*ep*pp = 1*3*2 = 6", "--expert-model-parallel-size"});
}

TEST(ParallelValidation, EpMustDivideExperts) {
  expect_error([] { validate_layout(cfg(1, 1, 1, 4, 1), 8, dims(2, 6)); },
               {"--num-experts 6", "--expert-model-parallel-size 4"});
  expect_error([] { validate_layout(cfg(1, 1, 1, 2, 1), 4, dims(2, 0)); },
               {"needs routed experts", "--num-experts 0"});
  EXPECT_NO_THROW(validate_layout(cfg(1, 1, 1, 4, 1), 8, dims(2, 8)));
}

TEST(ParallelValidation, PpMustDivideLayersUnlessUneven) {
  expect_error([] { validate_layout(cfg(1, 4, 1, 1, 0), 4, dims(6, 0)); },
               {"--num-layers 6", "--pipeline-model-parallel-size 4",
                "--decoder-first-pipeline-num-layers"});
  ParallelConfig c = cfg(1, 4, 1, 1, 0);
  c.first_stage_layers = 1;  // 7 = 1 + 3 * 2
  EXPECT_NO_THROW(validate_layout(c, 4, dims(7, 0)));
  EXPECT_EQ(stage_num_layers(c, 7, 0), 1);
  EXPECT_EQ(stage_num_layers(c, 7, 3), 2);
  c.last_stage_layers = 1;  // 7 - 2 = 5 over 2 middle stages: uneven
  expect_error([&] { validate_layout(c, 4, dims(7, 0)); },
               {"leave 5 layers for the 2 middle pipeline stages", "split evenly"});
  c = cfg(1, 2, 1, 1, 0);
  c.first_stage_layers = 3;
  c.last_stage_layers = 3;
  expect_error([&] { validate_layout(c, 2, dims(7, 0)); },
               {"leave 1 layers for 0 middle pipeline stages", "--num-layers 7"});
  c = cfg(1, 1, 1, 1, 0);
  c.first_stage_layers = 2;
  expect_error([&] { validate_layout(c, 1, dims(4, 0)); },
               {"uneven pipeline stages", "--pipeline-model-parallel-size is 1"});
}

TEST(ParallelValidation, TpWithEpNeedsSequenceParallel) {
  ParallelConfig c = cfg(2, 1, 1, 2, 1);
  expect_error([&] { validate_layout(c, 4, dims(2, 4)); },
               {"attention TP 2 with EP 2", "--sequence-parallel"});
  c.sequence_parallel = true;
  EXPECT_NO_THROW(validate_layout(c, 4, dims(2, 4)));
}

TEST(ParallelValidation, TpPpDpMappingNeedsEqualDataParallel) {
  ParallelConfig c = cfg(2, 2, 1, 4, 1);
  c.sequence_parallel = true;
  c.use_tp_pp_dp_mapping = true;
  expect_error([&] { validate_layout(c, 16, {}); },
               {"--use-tp-pp-dp-mapping", "dp = world/(tp*cp*pp) = 4", "edp = world/(etp*ep*pp) = 2"});
}

TEST(ParallelValidation, ModelDimensionsAndDegrees) {
  ModelDims m;
  m.num_attention_heads = 6;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 0), 4, m); },
               {"--num-attention-heads 6", "--tensor-model-parallel-size 4"});
  m = {};
  m.num_query_groups = 2;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 0), 4, m); }, {"--num-query-groups 2"});
  m = {};
  m.ffn_hidden = 10;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 0), 4, m); }, {"--ffn-hidden-size 10"});
  m = {};
  m.moe_ffn_hidden = 10;
  expect_error([&] { validate_layout(cfg(1, 1, 1, 1, 4), 4, m); },
               {"--moe-ffn-hidden-size 10", "expert TP 4"});
  m = {};
  m.seq_length = 6;
  expect_error([&] { validate_layout(cfg(1, 1, 2, 1, 0), 2, m); },
               {"--seq-length 6", "2 x --context-parallel-size = 4", "use --seq-length 8"});
  // Context parallelism under TP: each CP rank's S/cp positions split over TP.
  m.seq_length = 12;
  expect_error([&] { validate_layout(cfg(4, 1, 2, 1, 0), 8, m); },
               {"--seq-length 12", "tp*cp = 4*2", "divisible by 8"});
  // --cp-comm-type: p2p and allgather, one value or one per layer.
  m = {};
  ParallelConfig a2a = cfg(1, 1, 2, 1, 0);
  a2a.cp_comm_type = {"a2a"};
  expect_error([&] { validate_layout(a2a, 2, m); },
               {"--cp-comm-type a2a", "not built", "use p2p (ring) or allgather"});
  a2a.cp_comm_type = {"ring"};
  expect_error([&] { validate_layout(a2a, 2, m); }, {"--cp-comm-type ring is not one of"});
  a2a.cp_comm_type = {"p2p", "allgather", "p2p"};
  m.num_layers = 2;
  expect_error([&] { validate_layout(a2a, 2, m); },
               {"--cp-comm-type has 3 values for 2 layers"});
  a2a.cp_comm_type = {"p2p", "all_gather"};
  EXPECT_NO_THROW(validate_layout(a2a, 2, m));
  m = {};
  ParallelConfig sp = cfg(4, 1, 1, 1, 0);
  sp.sequence_parallel = true;
  m.seq_length = 6;
  expect_error([&] { validate_layout(sp, 4, m); }, {"--seq-length 6", "tp*cp = 4*1"});
  expect_error([] { validate_layout(cfg(0, 1, 1, 1, 0), 4, {}); },
               {"--tensor-model-parallel-size 0 must be >= 1"});
  expect_error([] { validate_layout(cfg(1, 1, 1, 1, -1), 4, {}); },
               {"--expert-tensor-parallel-size -1"});
  ParallelConfig t;
  t.timeout_minutes = 0;
  expect_error([&] { validate_layout(t, 1, {}); }, {"--distributed-timeout-minutes 0"});
  expect_error([] { validate_layout(ParallelConfig{}, 0, {}); }, {"world size 0"});
  expect_error([] { ProcessGroups(make_layout(ParallelConfig{}, 2), 2); },
               {"rank 2 outside the world"});
}

// What a TP / ETP layout needs beyond the degrees: the sequence split by position over TP (the
// MoE layer's tokens, with or without --sequence-parallel), the shared experts' width and the
// padded vocabulary split over TP. The transformer block requires S % TP == 0 for dense models
// without --sequence-parallel too: refused here, before step 0, as for MoE models.
TEST(ParallelValidation, TensorParallelSplitsOfTheModel) {
  ModelDims m = dims(2, 4);
  m.seq_length = 6;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 1), 4, m); },
               {"--seq-length 6 is not divisible by --tensor-model-parallel-size 4",
                "multiple of 4"});
  m.seq_length = 8;
  EXPECT_NO_THROW(validate_layout(cfg(4, 1, 1, 1, 1), 4, m));
  ModelDims dense = dims(2, 0);
  dense.seq_length = 6;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 1), 4, dense); },
               {"--seq-length 6 is not divisible by --tensor-model-parallel-size 4",
                "multiple of 4"});
  dense.seq_length = 8;
  EXPECT_NO_THROW(validate_layout(cfg(4, 1, 1, 1, 1), 4, dense));
  m.shared_ffn_hidden = 6;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 1), 4, m); },
               {"--moe-shared-expert-intermediate-size 6", "--tensor-model-parallel-size 4",
                "multiple of 4"});
  m.shared_ffn_hidden = 0;  // none
  EXPECT_NO_THROW(validate_layout(cfg(4, 1, 1, 1, 1), 4, m));
  m.vocab_size = 66;
  expect_error([&] { validate_layout(cfg(4, 1, 1, 1, 1), 4, m); },
               {"padded vocabulary of 66 entries", "--tensor-model-parallel-size 4",
                "--make-vocab-size-divisible-by to a multiple of 4"});
  m.vocab_size = 128;
  EXPECT_NO_THROW(validate_layout(cfg(4, 1, 1, 1, 1), 4, m));
}

TEST(ParallelFlags, ParseMegatronNames) {
  CLI::App app;
  ParallelConfig c;
  add_parallel_flags(app, c);
  app.parse(
      "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 2 "
      "--expert-model-parallel-size 4 --expert-tensor-parallel-size 2 --sequence-parallel "
      "--use-tp-pp-dp-mapping --distributed-timeout-minutes 0.5",
      false);
  EXPECT_EQ(c.tp, 2);
  EXPECT_EQ(c.pp, 2);
  EXPECT_EQ(c.cp, 2);
  EXPECT_EQ(c.ep, 4);
  EXPECT_EQ(c.etp, 2);
  EXPECT_TRUE(c.sequence_parallel);
  EXPECT_TRUE(c.use_tp_pp_dp_mapping);
  EXPECT_DOUBLE_EQ(c.timeout_seconds(), 30.0);
}

TEST(ProcessGroups, UnconnectedGroupSaysSo) {
  ProcessGroups g(make_layout(ParallelConfig{}, 1), 0);
  expect_error([&] { g.tp().communicator(); }, {"group 'tp' has no communicator"});
}

}  // namespace
}  // namespace moecore::parallel
