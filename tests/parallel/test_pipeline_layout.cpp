// Layer placement over pipeline stages against Megatron-Core: its get_num_layers_to_build and
// get_transformer_layer_offset ported literally below as the oracle over a sweep of layouts, the
// worked examples (even, virtual stages, uneven first/last, account-for, layout strings), and one
// test per error, each naming the flags.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/check.h"
#include "parallel/pipeline_layout.h"

namespace moecore::parallel {
namespace {

std::string error_of(const ParallelConfig& cfg, int64_t layers, int64_t mtp = 0) {
  try {
    pipeline_layout(cfg, layers, mtp);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_error(const ParallelConfig& cfg, int64_t layers, std::vector<std::string> parts,
                  int64_t mtp = 0) {
  const std::string msg = error_of(cfg, layers, mtp);
  ASSERT_FALSE(msg.empty()) << "accepted: " << pipeline_layout(cfg, layers, mtp).describe();
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
}

// (first layer, layers) of every virtual stage, in stage order.
std::vector<std::pair<int64_t, int64_t>> spans(const PipelineLayout& l) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const VirtualStage& s : l.stages) out.emplace_back(s.first_layer, s.num_layers);
  return out;
}

// Megatron's transformer_block.get_num_layers_to_build and transformer_layer.
// get_transformer_layer_offset (no layout string), as written there; 0 stands for None.
struct MegatronCfg {
  int64_t num_layers;
  int pp;
  int vp;  // 1: None
  int64_t first, last;
  bool acc_e = false, acc_l = false;
};
int64_t megatron_num_layers_to_build(const MegatronCfg& c, int vp_stage, int pp_rank) {
  const bool is_first = pp_rank == 0, is_last = pp_rank == c.pp - 1;
  int64_t per_rank = 0;
  if (c.first > 0 || c.last > 0) {
    int64_t to_distribute = c.num_layers;
    int left = c.pp;
    if (c.first > 0) to_distribute -= c.first, --left;
    if (c.last > 0) to_distribute -= c.last, --left;
    per_rank = left > 0 ? to_distribute / left : 0;
    if (is_first && c.first > 0) per_rank = c.first;
    if (is_last && c.last > 0) per_rank = c.last;
  } else {
    per_rank = (c.num_layers + c.acc_e + c.acc_l) / c.pp;
  }
  int64_t n = c.vp > 1 && c.pp > 1 ? per_rank / c.vp : per_rank;
  if (c.acc_e && vp_stage == 0 && is_first) n -= 1;
  if (c.acc_l && vp_stage == c.vp - 1 && is_last) n -= 1;
  return n;
}
int64_t megatron_offset(const MegatronCfg& c, int vp_stage, int pp_rank) {
  if (c.pp == 1) return 0;
  if (c.first > 0 || c.last > 0) {
    const int middle_stages = c.pp - int{c.first > 0} - int{c.last > 0};
    const int64_t middle = c.num_layers - c.first - c.last;
    const int middle_rank = c.first > 0 ? pp_rank - 1 : pp_rank;
    if (c.vp > 1) {
      const int64_t f_chunk = c.first / c.vp, l_chunk = c.last / c.vp, m_chunk = middle / c.vp;
      const int64_t total = f_chunk + m_chunk + l_chunk;
      if (pp_rank == 0) return vp_stage * total;
      // Megatron divides by middle_stages even when it is 0 (PP 2 with both uneven stages and
      // VP raises ZeroDivisionError there); the middle term is 0 then.
      return vp_stage * total + f_chunk +
             (middle_stages > 0 ? middle_rank * (m_chunk / middle_stages) : 0);
    }
    const int64_t per = middle_stages > 0 ? middle / middle_stages : 0;
    return pp_rank == 0 ? 0 : middle_rank * per + c.first;
  }
  const int64_t n = c.num_layers + c.acc_e + c.acc_l;
  const int64_t per_rank = n / c.pp;
  int64_t offset = c.vp > 1 ? vp_stage * (n / c.vp) + pp_rank * (per_rank / c.vp)
                            : pp_rank * per_rank;
  if (c.acc_e && !(vp_stage == 0 && pp_rank == 0)) offset -= 1;
  return offset;
}

TEST(PipelineLayout, MatchesMegatronOverASweep) {
  int compared = 0;
  for (int pp : {1, 2, 3, 4, 8}) {
    for (int vp : {1, 2, 3, 4}) {
      for (int64_t layers = 1; layers <= 40; ++layers) {
        for (int64_t first : {0, 1, 2, 3, 4, 6}) {
          for (int64_t last : {0, 1, 2, 4, 5}) {
            for (int acc = 0; acc < 4; ++acc) {
              ParallelConfig cfg;
              cfg.pp = pp;
              cfg.vp_stages = vp == 1 ? 0 : vp;
              cfg.first_stage_layers = static_cast<int>(first);
              cfg.last_stage_layers = static_cast<int>(last);
              cfg.account_for_embedding = acc & 1;
              cfg.account_for_loss = acc & 2;
              if (!error_of(cfg, layers).empty()) continue;
              const PipelineLayout l = pipeline_layout(cfg, layers);
              const MegatronCfg m{layers, pp, vp, first, last, cfg.account_for_embedding,
                                  cfg.account_for_loss};
              ASSERT_EQ(l.pp, pp);
              ASSERT_EQ(l.vp, vp);
              for (int c = 0; c < vp; ++c) {
                for (int r = 0; r < pp; ++r) {
                  SCOPED_TRACE(l.describe());
                  ASSERT_EQ(l.stage(r, c).num_layers, megatron_num_layers_to_build(m, c, r));
                  ASSERT_EQ(l.stage(r, c).first_layer, megatron_offset(m, c, r));
                  ASSERT_EQ(l.stage(r, c).embedding, r == 0 && c == 0);
                  ASSERT_EQ(l.stage(r, c).loss, r == pp - 1 && c == vp - 1);
                }
              }
              ++compared;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 500);
}

TEST(PipelineLayout, EvenAndVirtualStages) {
  ParallelConfig cfg;
  const PipelineLayout one = pipeline_layout(cfg, 5);
  ASSERT_EQ(one.stages.size(), 1u);
  EXPECT_EQ(spans(one), (std::vector<std::pair<int64_t, int64_t>>{{0, 5}}));
  EXPECT_TRUE(one.stages[0].embedding && one.stages[0].loss);

  cfg.pp = 4;
  EXPECT_EQ(spans(pipeline_layout(cfg, 8)),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 2}, {4, 2}, {6, 2}}));
  // 8 layers, PP 2, VP 2: rank 0 holds 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
  cfg.pp = 2;
  cfg.vp_stages = 2;
  const PipelineLayout l = pipeline_layout(cfg, 8, 1);
  EXPECT_EQ(l.stage(0, 0).first_layer, 0);
  EXPECT_EQ(l.stage(0, 1).first_layer, 4);
  EXPECT_EQ(l.stage(1, 0).first_layer, 2);
  EXPECT_EQ(l.stage(1, 1).first_layer, 6);
  EXPECT_TRUE(l.stage(0, 0).embedding && !l.stage(1, 0).embedding);
  EXPECT_TRUE(l.stage(1, 1).loss && !l.stage(0, 1).loss);
  EXPECT_EQ(l.stage(1, 1).num_mtp_layers, 1);  // MTP with the loss without a layout string
  EXPECT_EQ(l.describe(),
            "virtual stage 0 (rank 0, chunk 0): layers 0-1, embedding\n"
            "virtual stage 1 (rank 1, chunk 0): layers 2-3\n"
            "virtual stage 2 (rank 0, chunk 1): layers 4-5\n"
            "virtual stage 3 (rank 1, chunk 1): layers 6-7, 1 MTP, loss\n");
  EXPECT_EQ(stage_num_layers(cfg, 8, 0), 4);
  // --num-layers-per-virtual-pipeline-stage 1: four chunks per rank, round-robin.
  cfg.vp_stages = 0;
  cfg.layers_per_vp_stage = 1;
  EXPECT_EQ(cfg.vp(8), 4);
  EXPECT_EQ(spans(pipeline_layout(cfg, 8))[5], (std::pair<int64_t, int64_t>{5, 1}));
  EXPECT_EQ(pipeline_layout(cfg, 8).stage(1, 2).first_layer, 5);
}

TEST(PipelineLayout, UnevenFirstAndLastStages) {
  ParallelConfig cfg;
  cfg.pp = 4;
  cfg.first_stage_layers = 1;
  cfg.last_stage_layers = 3;
  EXPECT_EQ(spans(pipeline_layout(cfg, 10)),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 3}, {4, 3}, {7, 3}}));
  EXPECT_EQ(stage_num_layers(cfg, 10, 0), 1);
  EXPECT_EQ(stage_num_layers(cfg, 10, 3), 3);
  // Only the first given: the rest split over the other three.
  cfg.last_stage_layers = 0;
  EXPECT_EQ(spans(pipeline_layout(cfg, 7)),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {3, 2}, {5, 2}}));
  // With VP 2: every chunk of a rank holds its share / 2 (16 layers: 2 | 6 | 6 | 2).
  cfg.first_stage_layers = 2;
  cfg.last_stage_layers = 2;
  cfg.vp_stages = 2;
  EXPECT_EQ(spans(pipeline_layout(cfg, 16)),
            (std::vector<std::pair<int64_t, int64_t>>{
                {0, 1}, {1, 3}, {4, 3}, {7, 1}, {8, 1}, {9, 3}, {12, 3}, {15, 1}}));
  // PP 2: both stages given, no middle.
  ParallelConfig two;
  two.pp = 2;
  two.first_stage_layers = 3;
  two.last_stage_layers = 5;
  EXPECT_EQ(spans(pipeline_layout(two, 8)),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 5}}));
}

TEST(PipelineLayout, AccountForEmbeddingAndLoss) {
  ParallelConfig cfg;
  cfg.pp = 4;
  cfg.account_for_embedding = true;
  cfg.account_for_loss = true;
  // 6 layers + embedding + loss = 8 slots: 1 | 2 | 2 | 1.
  EXPECT_EQ(spans(pipeline_layout(cfg, 6)),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {3, 2}, {5, 1}}));
  cfg.account_for_loss = false;
  EXPECT_EQ(spans(pipeline_layout(cfg, 7)),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {3, 2}, {5, 2}}));
  // With VP 2: 14 + 2 = 16 slots, 2 per virtual stage, the first and last one short.
  cfg.account_for_loss = true;
  cfg.vp_stages = 2;
  const PipelineLayout l = pipeline_layout(cfg, 14);
  EXPECT_EQ(l.stage(0, 0).num_layers, 1);
  EXPECT_EQ(l.stage(3, 1).num_layers, 1);
  EXPECT_EQ(l.stage(0, 1).first_layer, 7);
  // PP 1: one stage of all layers.
  ParallelConfig single;
  single.account_for_embedding = true;
  EXPECT_EQ(spans(pipeline_layout(single, 3)), (std::vector<std::pair<int64_t, int64_t>>{{0, 3}}));
}

TEST(PipelineLayout, LayoutStrings) {
  EXPECT_EQ(parse_pipeline_layout("E|(t|)*3,m|m||L"),
            (std::vector<std::string>{"E", "t", "t", "t", "m", "m", "", "L"}));
  EXPECT_EQ(parse_pipeline_layout("Ettt|(tt|)*2,m|L"),
            (std::vector<std::string>{"Ettt", "tt", "tt", "m", "L"}));
  EXPECT_EQ(parse_pipeline_layout("Et*3|t*2L"), (std::vector<std::string>{"Ettt", "ttL"}));
  ParallelConfig cfg;
  // DeepSeek-V3 style: 61 decoder layers and one MTP layer over PP 16 x VP 2.
  cfg.pp = 16;
  cfg.layout = "Et*3|(tt|)*29,m|L";
  EXPECT_EQ(cfg.vp(61), 2);
  const PipelineLayout ds = pipeline_layout(cfg, 61, 1);
  ASSERT_EQ(ds.stages.size(), 32u);
  EXPECT_EQ(ds.stage(0, 0).num_layers, 3);
  EXPECT_TRUE(ds.stage(0, 0).embedding);
  EXPECT_EQ(ds.stage(1, 0).first_layer, 3);
  EXPECT_EQ(ds.stage(15, 0).first_layer, 3 + 14 * 2);
  EXPECT_EQ(ds.stage(0, 1).first_layer, 3 + 15 * 2);  // chunk 1 follows all of chunk 0
  EXPECT_EQ(ds.stage(13, 1).first_layer + ds.stage(13, 1).num_layers, 61);
  EXPECT_EQ(ds.stage(14, 1).num_layers, 0);
  EXPECT_EQ(ds.stage(14, 1).num_mtp_layers, 1);
  EXPECT_TRUE(ds.stage(15, 1).loss);
  EXPECT_EQ(ds.stage(15, 1).num_layers, 0);
  EXPECT_EQ(stage_num_layers(cfg, 61, 14, 1), 2);
  // The same string at PP 8 is four virtual stages per rank.
  cfg.pp = 8;
  EXPECT_EQ(pipeline_layout(cfg, 61, 1).vp, 4);
  // A simple one with empty stages: PP 2, VP 2.
  cfg.pp = 2;
  cfg.layout = "Ett|tt||ttL";
  const PipelineLayout small = pipeline_layout(cfg, 6);
  EXPECT_EQ(spans(small), (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 2}, {4, 0}, {4, 2}}));
}

// Megatron's embedding group as moecore sums it: every pp rank holding the word table (the
// embedding's, the MTP layers', a tied loss's), and the stages after the MTP layers' marked.
TEST(PipelineLayout, WordTableRanksAndTheStagesAfterTheMtpLayers) {
  ParallelConfig cfg;
  cfg.pp = 16;
  cfg.layout = "Et*3|(tt|)*29,m|L";
  const PipelineLayout ds = pipeline_layout(cfg, 61, 1);
  for (size_t i = 0; i < ds.stages.size(); ++i)
    EXPECT_EQ(ds.stages[i].mtp_before, i == ds.stages.size() - 1) << "virtual stage " << i;
  EXPECT_EQ(word_table_ranks(ds, false), (std::vector<int>{0, 14}));  // DeepSeek-V3: untied
  EXPECT_EQ(word_table_ranks(ds, true), (std::vector<int>{0, 14, 15}));
  // Empty stages between the MTP layers and the loss pass the hidden states on.
  cfg.pp = 4;
  cfg.layout = "Ett|ttmm||L";
  const PipelineLayout gap = pipeline_layout(cfg, 4, 2);
  EXPECT_EQ(gap.stages[1].mtp_before, false);
  EXPECT_EQ(gap.stages[2].mtp_before, true);
  EXPECT_EQ(gap.stages[3].mtp_before, true);
  EXPECT_EQ(word_table_ranks(gap, true), (std::vector<int>{0, 1, 3}));
  // Beside the embedding, and the default placement: as Megatron's first and last ranks.
  cfg.pp = 2;
  cfg.layout = "Ettttm|L";
  EXPECT_EQ(word_table_ranks(pipeline_layout(cfg, 4, 1), false), (std::vector<int>{0}));
  EXPECT_EQ(word_table_ranks(pipeline_layout(cfg, 4, 1), true), (std::vector<int>{0, 1}));
  cfg.layout.clear();
  const PipelineLayout plain = pipeline_layout(cfg, 4, 1);
  EXPECT_FALSE(plain.stages.back().mtp_before);
  EXPECT_EQ(word_table_ranks(plain, false), (std::vector<int>{0, 1}));
  EXPECT_EQ(word_table_ranks(pipeline_layout(cfg, 4, 0), false), (std::vector<int>{}));
  EXPECT_EQ(word_table_ranks(pipeline_layout(cfg, 4, 0), true), (std::vector<int>{0, 1}));
}

TEST(PipelineLayout, ErrorsNameTheFlags) {
  ParallelConfig cfg;
  cfg.pp = 2;
  // A model that cannot be split: Megatron #1304/#1778 (never shrink it silently).
  expect_error(cfg, 7, {"--num-layers 7", "--pipeline-model-parallel-size 2"});
  cfg.account_for_embedding = true;
  expect_error(cfg, 8, {"--num-layers 8", "+1", "--account-for-embedding"});
  cfg.account_for_embedding = false;
  cfg.vp_stages = 3;
  expect_error(cfg, 8, {"--num-virtual-stages-per-pipeline-rank", "3 virtual stages"});
  // Uneven stages that drop layers, take too many, or leave a middle stage empty.
  ParallelConfig u;
  u.pp = 4;
  u.first_stage_layers = 2;
  u.last_stage_layers = 2;
  expect_error(u, 11, {"7 layers", "--decoder-first-pipeline-num-layers 2", "split evenly"});
  expect_error(u, 3, {"--num-layers 3", "--decoder-last-pipeline-num-layers 2"});
  expect_error(u, 4, {"0 layers for 2 middle", "--num-layers 4"});
  u.vp_stages = 2;
  u.first_stage_layers = 3;
  expect_error(u, 11, {"--decoder-first-pipeline-num-layers 3", "2 virtual stages"});
  u.first_stage_layers = 2;
  expect_error(u, 10, {"each middle pipeline stage holds 3", "--num-virtual-stages-per-pipeline-rank"});
  // Conflicting flags.
  ParallelConfig c;
  c.pp = 2;
  c.vp_stages = 2;
  c.layers_per_vp_stage = 2;
  expect_error(c, 8, {"--num-layers-per-virtual-pipeline-stage (2)", "--num-virtual-stages-per-pipeline-rank (2)", "keep one"});
  c.vp_stages = 0;
  c.first_stage_layers = 2;
  expect_error(c, 8, {"--num-layers-per-virtual-pipeline-stage 2", "--num-virtual-stages-per-pipeline-rank instead"});
  c.layers_per_vp_stage = 3;
  c.first_stage_layers = 0;
  expect_error(c, 8, {"--num-layers-per-virtual-pipeline-stage 3", "4 layers"});
  ParallelConfig acc;
  acc.pp = 2;
  acc.first_stage_layers = 3;
  acc.account_for_loss = true;
  expect_error(acc, 8, {"--decoder-first-pipeline-num-layers (3)", "--account-for-loss-in-pipeline-split (true)"});
  ParallelConfig lay;
  lay.pp = 2;
  lay.layout = "Et|tL";
  lay.last_stage_layers = 1;
  expect_error(lay, 2, {"--pipeline-model-parallel-layout \"Et|tL\"", "--decoder-last-pipeline-num-layers (1)"});
  lay.last_stage_layers = 0;
  lay.vp_stages = 1;
  expect_error(lay, 2, {"--num-virtual-stages-per-pipeline-rank (1)", "--pipeline-model-parallel-layout"});
  lay.vp_stages = 0;
  ParallelConfig one;
  one.vp_stages = 2;
  expect_error(one, 4, {"--pipeline-model-parallel-size > 1"});
  one.vp_stages = 0;
  one.first_stage_layers = 1;
  expect_error(one, 4, {"--pipeline-model-parallel-size is 1"});
  // Layout strings: stages not a multiple of pp, E / L misplaced or repeated, counts wrong, MTP rules.
  lay.layout = "Et|t|tL";
  expect_error(lay, 3, {"3 stages", "--pipeline-model-parallel-size 2"});
  lay.layout = "tE|tL";
  expect_error(lay, 2, {"embedding E", "first letter of the first stage"});
  lay.layout = "Et|EtL";
  expect_error(lay, 2, {"embedding E", "it has 2 E"});
  lay.layout = "Et|Lt";
  expect_error(lay, 2, {"loss L", "last letter of the last stage"});
  lay.layout = "Ett|tL";
  expect_error(lay, 4, {"places 3 decoder layers", "--num-layers is 4"});
  lay.layout = "Et|tmL";
  expect_error(lay, 2, {"places 1 MTP layers", "--mtp-num-layers is 2"}, 2);
  lay.layout = "Et|mtL";
  expect_error(lay, 2, {"follows an MTP layer"}, 1);
  lay.layout = "Ett|tm||L";
  expect_error(lay, 3, {"stage 1 (rank 1, virtual stage 0 of 2)", "last virtual stage"}, 1);
  lay.layout = "E|(t|)*3,m|m||L";  // Megatron's help example: its MTP layers sit in two stages
  lay.pp = 4;
  expect_error(lay, 3, {"spread over 2 stages"}, 2);
  lay.pp = 2;
  lay.layout = "Et|tX";
  expect_error(lay, 2, {"invalid character 'X'", "E (embedding)"});
  lay.layout = "Et|t*99999999L";
  expect_error(lay, 2, {"repeat count"});
  EXPECT_NE(error_of(cfg, 0).find("--num-layers 0"), std::string::npos);
}

TEST(PipelineLayout, ValidateLayoutPlacesEveryLayer) {
  ParallelConfig cfg;
  cfg.pp = 2;
  cfg.layout = "Ett|tL";
  ModelDims dims;
  dims.num_layers = 3;
  EXPECT_NO_THROW(validate_layout(cfg, 2, dims));
  dims.num_layers = 4;
  try {
    validate_layout(cfg, 2, dims);
    ADD_FAILURE() << "a layout of 3 layers accepted for --num-layers 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--num-layers is 4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore::parallel
