// --bf16 without --fp32-residual-connection keeps the residual stream in bf16, as Megatron-Core
// does (ModelConfig::bf16_residual): the embedding's output and every residual add's are rounded
// to bf16 values, and the inputs the norms' backwards read (each layer's input, x1, the final
// norm's) are kept as bf16 copies while their f32 forms pass through workspaces that later
// layers overwrite. Checked: a pipeline stage's output holds bf16 values (f32 values with the
// flag); the whole model equals its two pipeline stages bitwise (the whole model's
// pass-through buffers are overwritten by its later layers before its backward reads their
// kept copies; the split model's boundary is kept in f32); the norms' outputs that Megatron-Core
// writes in bf16 (n2, the hidden states entering the MoE layer or MLP, and the final norm's)
// hold bf16 values; the kept activations shrink by exactly the bytes of the f32 copies replaced
// by bf16 ones.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/layer_testing.h"
#include "common/pipeline_stages.h"
#include "common/tiny_model_config.h"
#include "model/gpt_model.h"
#include "ops/cast.h"

namespace moecore::model {
namespace {

using testing::host;

ModelConfig resid_config() {
  ModelConfig cfg = testing::tiny_moe_config(4);
  cfg.hidden = 32;
  cfg.ffn_hidden = 12;
  cfg.init_std = 0.1;
  cfg.moe_layer_pattern = {1, 0, 1, 1};
  cfg.moe.router.aux_loss_coeff = 0.1;
  cfg.moe.ffn_hidden = 6;
  cfg.tie_embeddings = false;
  cfg.hidden_dropout = 0.2;  // the dropout-add's output is rounded too
  cfg.position_embedding = PositionEmbedding::LearnedAbsolute;  // the embedding's sum rounded
  cfg.bf16 = true;
  return cfg;
}

int64_t not_bf16_values(const float* x, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += ops::f32_bf16_rounded(x[i]) != x[i];
  return bad;
}

// A stage of layers [0, 2) with the embedding: its output (the sent boundary, kept f32) is the
// second layer's residual add.
TEST(Bf16Residual, StageOutputHoldsBf16ValuesUnlessFp32ResidualConnection) {
  for (bool fp32_residual : {false, true}) {
    SCOPED_TRACE(fp32_residual ? "--fp32-residual-connection" : "bf16 residual");
    ModelConfig cfg = resid_config();
    cfg.fp32_residual_connection = fp32_residual;
    const int64_t B = 2, n = B * cfg.seq_length;
    GPTModel<float> first(cfg, B, 7, nullptr, false, cpu_exec(),
                          {parallel::VirtualStage{0, 2, 0, true, false}});
    auto [ids, targets, counters] = testing::two_micro_batches(n, cfg.vocab_size);
    std::vector<ops::MicroBatchReport> r(1);
    std::vector<int64_t> t(cfg.num_experts);
    first.forward_chunk(0, MicroBatchIO{ids[0].data(), targets[0].data(), &r[0], t.data(),
                                        &counters[0]},
                        nullptr, 0);
    const int64_t bad = not_bf16_values(host(first.chunk_output(0)), first.boundary_elems());
    if (fp32_residual)
      EXPECT_GT(bad, first.boundary_elems() / 2) << "the f32 stream is not rounded";
    else
      EXPECT_EQ(bad, 0);
  }
}

// The whole model (its stream through two alternating workspaces, each layer's input and x1
// read back from their bf16 copies) equals the model split in two pipeline stages (the boundary
// kept in f32) bitwise: losses and every gradient, over two micro-batches.
TEST(Bf16Residual, WholeModelEqualsItsPipelineStagesBitwise) {
  for (bool fp32_residual : {false, true}) {
    SCOPED_TRACE(fp32_residual ? "--fp32-residual-connection" : "bf16 residual");
    ModelConfig cfg = resid_config();
    cfg.fp32_residual_connection = fp32_residual;
    const int64_t B = 2, n = B * cfg.seq_length, E = cfg.num_experts;
    GPTModel<float> whole(cfg, B, 7);
    GPTModel<float> first(cfg, B, 7, nullptr, false, cpu_exec(),
                          {parallel::VirtualStage{0, 2, 0, true, false}});
    GPTModel<float> last(cfg, B, 7, nullptr, false, cpu_exec(),
                         {parallel::VirtualStage{2, 2, 0, false, true}});
    const testing::StageReports reports = testing::run_whole_and_two_stages(
        whole, first, last, testing::two_micro_batches(n, cfg.vocab_size), E);
    const auto& rw = reports.whole;
    const auto& rl = reports.last;
    for (int mb = 0; mb < 2; ++mb) EXPECT_EQ(rl[mb].lm_loss_sum, rw[mb].lm_loss_sum) << mb;
    int compared = 0;
    for (const Param& w : whole.params().params()) {
      const ParamRegistry& reg =
          first.params().find(w.name()) != nullptr ? first.params() : last.params();
      const Param* a = reg.find(w.name());
      ASSERT_NE(a, nullptr) << w.name() << " is on no stage";
      EXPECT_EQ(std::memcmp(host(a->grad_as<float>()), host(w.grad_as<float>()),
                            sizeof(float) * w.local_numel()),
                0)
          << w.name();
      ++compared;
    }
    EXPECT_EQ(compared, static_cast<int>(whole.params().params().size()));
  }
}

// The router's input (n2 of the last layer, a MoE layer) and the final norm's output (the
// head's input) after a forward: bf16 values with the bf16 stream, as Megatron-Core's bf16
// norms write them (the router upcasts them for its f32 logits); f32 values with the flag.
TEST(Bf16Residual, NormOutputsHoldBf16ValuesUnlessFp32ResidualConnection) {
  for (bool fp32_residual : {false, true}) {
    SCOPED_TRACE(fp32_residual ? "--fp32-residual-connection" : "bf16 residual");
    ModelConfig cfg = resid_config();
    cfg.fp32_residual_connection = fp32_residual;
    const int64_t B = 2, n = B * cfg.seq_length;
    GPTModel<float> model(cfg, B, 7);
    auto [ids, targets, counters] = testing::two_micro_batches(n, cfg.vocab_size);
    std::vector<ops::MicroBatchReport> r(1);
    std::vector<int64_t> t(cfg.num_experts);
    model.forward(
        MicroBatchIO{ids[0].data(), targets[0].data(), &r[0], t.data(), &counters[0]});
    const moe::Router<float>* last = model.routers().back();  // layer L - 1's
    const int64_t bad_n2 = not_bf16_values(host(last->saved().x_TH), n * cfg.hidden);
    const int64_t bad_final = not_bf16_values(host(model.final_norm_output()), n * cfg.hidden);
    if (fp32_residual) {
      EXPECT_GT(bad_n2, n * cfg.hidden / 2) << "n2 is not rounded";
      EXPECT_GT(bad_final, n * cfg.hidden / 2) << "the final norm's output is not rounded";
    } else {
      EXPECT_EQ(bad_n2, 0);
      EXPECT_EQ(bad_final, 0);
    }
  }
}

// The planner's view (a sizing pass): the kept f32 stream (L + 1 boundaries) and the blocks'
// f32 x1 become bf16 copies of each layer's input, of x1 and of the final norm's input:
// (4 (L + 1) + 4 L) - 2 (2 L + 1) = 4 L + 2 bytes per token and hidden unit fewer; n2 (every
// layer's, MoE or dense) and the final norm's output are kept as bf16 alone, their f32 forms
// in workspaces the model has anyway (the block's dnorm, the stream's pass-through buffer):
// 2 (L + 1) bytes fewer again, 6 L + 4 in all.
TEST(Bf16Residual, KeptActivationsHoldTheStreamInBf16) {
  ModelConfig cfg = resid_config();
  const int64_t B = 2, L = cfg.num_layers;
  const int64_t TH = B * cfg.seq_length * cfg.hidden;  // 320: bf16 rows stay 64-byte aligned
  ModelConfig f32 = cfg;
  f32.fp32_residual_connection = true;
  GPTModel<float> m16(cfg, B, 7, nullptr, /*size_only=*/true);
  GPTModel<float> m32(f32, B, 7, nullptr, /*size_only=*/true);
  const int64_t a16 = static_cast<int64_t>(m16.arena().bytes_of(MemKind::Activations));
  const int64_t a32 = static_cast<int64_t>(m32.arena().bytes_of(MemKind::Activations));
  EXPECT_EQ(a32 - a16, (6 * L + 4) * TH);
  // The workspace stays: nothing new is planned for the f32 forms.
  EXPECT_EQ(m16.arena().bytes_of(MemKind::Workspace) - m32.arena().bytes_of(MemKind::Workspace),
            2 * 4 * TH);  // the two pass-through buffers of the stream only
}

}  // namespace
}  // namespace moecore::model
