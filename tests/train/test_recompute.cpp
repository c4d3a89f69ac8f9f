// Activation recomputation repeats the forward's arithmetic, so every mode must train the
// same model bit for bit: the same losses, gradients, weights and router state after several
// steps with gradient accumulation, while the memory plan keeps fewer activations.
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "core/arena.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore {

using testing::host;
namespace {

// A small model touching every recomputed piece: MoE and dense layers, a shared expert,
// qk-layernorm and a qkv bias, input jitter, and 2 micro-batches per step; the mla variants
// with multi-latent attention instead of the QKV attention.
cli::TrainFlags base_flags(const std::string& variant) {
  cli::TrainFlags f = cli::small_moe_train_flags();
  f.untie_embeddings = true;
  f.model.qk_layernorm = true;
  f.model.add_qkv_bias = true;
  f.model.moe.shared_ffn_hidden = 16;
  f.train.train_iters = 4;
  if (variant == "balancing") {
    // Sigmoid + expert bias + group-limited routing, global and sequence aux losses (their
    // per-step accumulators must not count a recomputing forward), capacity dropping.
    f.router.score_function = "sigmoid";
    f.model.moe.router.enable_expert_bias = true;
    f.model.moe.router.num_groups = 2;
    f.model.moe.router.group_topk = 1;
    f.router.load_balancing = {"global_aux_loss", "seq_aux_loss"};
    f.router.aux_loss_coeff = {1e-2, 1e-3};
    f.model.moe.router.capacity_factor = 1.0;
  } else if (variant == "shared_gate_bias_bf16") {
    // The shared expert's gate (under "moe" its forward reruns in the backward; under
    // "shared_experts" its output stays for the gate) and the attention output bias.
    f.model.moe.shared_expert_gate = true;
    f.model.add_attention_output_bias = true;
    f.bf16 = true;
  } else if (variant == "mla" || variant == "mla_bf16") {
    // Multi-latent attention in every layer (q LoRA, the latents' norms with --qk-layernorm,
    // YaRN, v narrower than q / k: padded heads), also under --bf16.
    f.model.multi_latent_attention = true;
    f.model.add_qkv_bias = false;  // the QKV attention's
    f.model.mla.q_lora_rank = 16;
    f.model.mla.kv_lora_rank = 12;
    f.model.mla.qk_head_dim = 6;
    f.model.mla.qk_pos_emb_head_dim = 4;
    f.model.mla.v_head_dim = 8;
    f.model.mla.rope_type = ops::RopeType::Yarn;
    f.model.mla.yarn.scaling_factor = 4.0;
    f.model.mla.yarn.original_max_position_embeddings = 4;
    f.model.mla.yarn.mscale_all_dim = 0.8;
    f.bf16 = variant == "mla_bf16";
  } else if (variant == "quantile_bf16") {
    f.router.load_balancing = {"quantile_balancing"};
    f.router.aux_loss_coeff = {0.0};
    f.model.moe.router.quantile_ema = 0.9;
    f.bf16 = true;
  }
  return f;
}

struct RunResult {
  std::vector<double> loss, aux, grad_norm;
  std::vector<char> weights, grads;
  size_t planned = 0, recomputed = 0, saving = 0;
};

RunResult train_with(const std::string& variant, const std::string& granularity,
               const std::string& method, int64_t num_layers,
               const std::vector<std::string>& modules) {
  cli::TrainFlags f = base_flags(variant);
  f.recompute_granularity = granularity;
  f.recompute_method = method;
  f.model.recompute.num_layers = num_layers;
  if (!modules.empty()) f.model.recompute.module_names = modules;
  cli::finalize_train_flags(f);
  train::Trainer trainer(f.model, f.train);
  RunResult r;
  for (int i = 0; i < 4; ++i) {
    train::StepMetrics m = trainer.train_step();
    r.loss.push_back(m.lm_loss);
    r.aux.push_back(m.aux_loss);
    r.grad_norm.push_back(m.grad_norm);
  }
  auto& model = trainer.model();
  const ParamRegistry& p = model.params();
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const char* w = static_cast<const char*>(host(p.flat_data(k)));
    const char* g = static_cast<const char*>(host(p.flat_grad(k)));
    const size_t bytes = static_cast<size_t>(p.numel(k)) * sizeof(float);
    if (bytes == 0) continue;
    r.weights.insert(r.weights.end(), w, w + bytes);
    r.grads.insert(r.grads.end(), g, g + bytes);
  }
  r.planned = model.arena().planned_bytes();
  r.recomputed = model.arena().bytes_of(MemKind::Recomputed);
  r.saving = model.arena().recompute_saving_bytes();
  return r;
}

void expect_bitwise_equal(const RunResult& ref, const RunResult& r, const std::string& what) {
  for (size_t i = 0; i < ref.loss.size(); ++i) {
    EXPECT_EQ(ref.loss[i], r.loss[i]) << what << " lm loss, iteration " << i + 1;
    EXPECT_EQ(ref.aux[i], r.aux[i]) << what << " aux loss, iteration " << i + 1;
    EXPECT_EQ(ref.grad_norm[i], r.grad_norm[i]) << what << " grad norm, iteration " << i + 1;
  }
  ASSERT_EQ(ref.weights.size(), r.weights.size());
  EXPECT_EQ(std::memcmp(ref.weights.data(), r.weights.data(), ref.weights.size()), 0)
      << what << ": weights differ after 4 steps";
  EXPECT_EQ(std::memcmp(ref.grads.data(), r.grads.data(), ref.grads.size()), 0)
      << what << ": last step's gradients differ";
}

class Recompute : public ::testing::TestWithParam<std::string> {};

TEST_P(Recompute, EveryModeTrainsTheSameModelBitwise) {
  const std::string variant = GetParam();
  const RunResult ref = train_with(variant, "", "", 0, {});
  EXPECT_EQ(ref.recomputed, 0u);
  EXPECT_EQ(ref.saving, 0u);
  struct Mode {
    std::string granularity, method;
    int64_t num_layers;
    std::vector<std::string> modules;
  };
  std::vector<Mode> modes = {
      {"selective", "", 0, {}},  // Megatron's default: core_attn
      {"selective", "", 0, {"layernorm", "moe_act", "shared_experts", "mlp"}},
      {"selective", "", 0, {"moe", "core_attn", "layernorm"}},
      {"full", "uniform", 1, {}},
      {"full", "uniform", 2, {}},
      {"full", "uniform", 3, {}},  // chunks [0, 3) and [3]
      {"full", "block", 2, {}},
  };
  // Multi-latent attention's own module: q, k, v from the saved latents; with the core too.
  // Under --bf16 only the attention's selective modes (the f32 variant runs every mode).
  if (variant == "mla_bf16") modes.resize(1);
  if (variant.starts_with("mla")) {
    modes.push_back({"selective", "", 0, {"mla_up_proj"}});
    modes.push_back({"selective", "", 0, {"mla_up_proj", "core_attn", "layernorm", "moe_act"}});
  }
  for (const Mode& m : modes) {
    std::string what = m.granularity + " " + m.method + " " + std::to_string(m.num_layers);
    for (const auto& s : m.modules) what += " " + s;
    const RunResult r = train_with(variant, m.granularity, m.method, m.num_layers, m.modules);
    expect_bitwise_equal(ref, r, what);
    EXPECT_GT(r.recomputed, 0u) << what;
    // The plan shrinks by exactly the reported saving.
    EXPECT_GT(r.saving, 0u) << what;
    EXPECT_EQ(r.planned + r.saving, ref.planned) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, Recompute,
                         ::testing::Values("softmax_jitter", "balancing", "quantile_bf16",
                                           "shared_gate_bias_bf16", "mla", "mla_bf16"));

TEST(Recompute, BadFlagsStopWithTheFix) {
  auto expect_error = [](const std::string& g, const std::string& m, int64_t n,
                         std::vector<std::string> modules, const std::string& needle) {
    cli::TrainFlags f = base_flags("softmax_jitter");
    f.recompute_granularity = g;
    f.recompute_method = m;
    f.model.recompute.num_layers = n;
    if (!modules.empty()) f.model.recompute.module_names = modules;
    try {
      cli::finalize_train_flags(f);
      ADD_FAILURE() << "accepted " << g << " " << m << " " << n;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("full", "", 1, {}, "--recompute-method uniform or block");
  expect_error("full", "uniform", 0, {}, "--recompute-num-layers=0 must be between 1 and");
  expect_error("full", "block", 5, {}, "--recompute-num-layers=5 must be between 1 and");
  expect_error("selective", "uniform", 1, {}, "apply to --recompute-granularity full only");
  expect_error("", "block", 1, {}, "need --recompute-granularity full");
  expect_error("selective", "", 0, {"attention"}, "unknown --recompute-modules entry 'attention'");
  expect_error("selective", "", 0, {"mla_up_proj"},
               "--recompute-modules mla_up_proj recomputes multi-latent attention's up "
               "projections: give --multi-latent-attention");
  expect_error("selective", "", 0, {"core_attn", "mla_up_proj"}, "give --multi-latent-attention");
}

}  // namespace
}  // namespace moecore
