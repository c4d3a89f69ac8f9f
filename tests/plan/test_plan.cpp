// moecore plan: parameter counts of the shipped configs against the published numbers, the
// memory figures against the trainer's own plan, the sizing pass allocating nothing, the JSON
// keys, the published layouts fitting, the figures docs/plan.md prints for them pinned, and
// --search returning layouts `moecore groups` accepts.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/bf16_gemm_paths.h"
#include "common/paths.h"
#include "common/testing.h"
#include "documented_figure.h"
#include "model/gpt_model.h"
#include "ops/cuda/reduce_workspace.h"
#include "ops/gemm_bf16.h"
#include "plan/layout_search.h"
#include "plan/param_count.h"
#include "plan/memory_model.h"
#include "plan/plan.h"
#include "plan/plan_command.h"
#include "plan/sizing_groups.h"
#include "cli/config_file.h"
#include "cli/megatron_compat.h"
#include "train/metrics.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore::plan {
namespace {

std::string config(const std::string& name) {
  return ::moecore::testing::source_dir() + "/configs/" + name + ".toml";
}

// The model of a shipped config, as `moecore plan --config` reads it (TP 1).
ModelSpec shipped(const std::string& name) {
  const auto args = cli::config_file_args(config(name));
  const cli::ParsedArgs a = cli::parse_megatron_argv(args, {}, cli::moecore_extra_choices());
  ModelSpec m = model_from_args(a);
  pad_vocab(m, a, 1);
  return m;
}

// `moecore plan ARGS` (with --config expanded as the command line does).
std::string plan_out(const std::vector<std::string>& args) {
  std::vector<std::string> v{"plan"};
  v.insert(v.end(), args.begin(), args.end());
  v = cli::expand_config_files(v);
  v.erase(v.begin());
  std::string out;
  EXPECT_EQ(run_plan(v, out), 0);
  return out;
}

int64_t peak_rss() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

constexpr double kB = 1e9;

// Published counts. Each publisher rounds its own way; each test says which, and the tolerance
// is what that rounding allows.
// DeepSeek-V3: "671B total parameters with 37B activated for each token"; "685B, which includes
// 671B of the main model weights and 14B of the Multi-Token Prediction (MTP) module weights"
// (DeepSeek-V3 Technical Report, arXiv:2412.19437, and the deepseek-ai/DeepSeek-V3 model card).
// Rounded to 1B (+-0.5). The 37B leaves out the embedding table (a lookup, no matmul): with it
// the count is 37.55B. The 685B is the checkpoint's count: the MTP module with its own copies of
// the embedding and output head (Megatron and count_params share them), plus about 0.04B of
// FP8 block-scale tensors that are not parameters (one fp32 per 128 x 128 block): 684.49B here,
// so +-0.55.
TEST(PlanParams, DeepSeekV3) {
  const ParamCounts c = count_params(shipped("deepseek-v3"));
  EXPECT_NEAR(c.total() / kB, 671, 0.5);
  EXPECT_NEAR((c.active() - c.embedding) / kB, 37, 0.5);
  EXPECT_NEAR((c.total_with_mtp() + c.embedding + c.head) / kB, 685, 0.55);
}

// Qwen3 model cards (Qwen/Qwen3-235B-A22B: "235B in total and 22B activated";
// Qwen/Qwen3-30B-A3B: "30.5B in total and 3.3B activated"). The cards truncate to their last
// digit (30.53 -> 30.5, 3.353 -> 3.3): the count lies in [published, published + 1 unit).
TEST(PlanParams, Qwen3_235B_A22B) {
  const ParamCounts c = count_params(shipped("qwen3-235b-a22b"));
  EXPECT_GE(c.total() / kB, 235);
  EXPECT_LT(c.total() / kB, 236);
  EXPECT_GE(c.active() / kB, 22);
  EXPECT_LT(c.active() / kB, 23);
}

TEST(PlanParams, Qwen3_30B_A3B) {
  const ParamCounts c = count_params(shipped("qwen3-30b-a3b"));
  EXPECT_GE(c.total() / kB, 30.5);
  EXPECT_LT(c.total() / kB, 30.6);
  EXPECT_GE(c.active() / kB, 3.3);
  EXPECT_LT(c.active() / kB, 3.4);
}

// Mistral AI, "Mixtral of experts" (mistral.ai/news/mixtral-of-experts): "46.7B total
// parameters but only uses 12.9B parameters per token"; "Cheaper, Better, Faster, Stronger"
// (mistral.ai/news/mixtral-8x22b): "39B active parameters out of 141B". Rounded to the last
// digit given (+-half of it); the active counts include the embedding and the head.
TEST(PlanParams, Mixtral8x7B) {
  const ParamCounts c = count_params(shipped("mixtral-8x7b"));
  EXPECT_NEAR(c.total() / kB, 46.7, 0.05);
  EXPECT_NEAR(c.active() / kB, 12.9, 0.05);
}

TEST(PlanParams, Mixtral8x22B) {
  const ParamCounts c = count_params(shipped("mixtral-8x22b"));
  EXPECT_NEAR(c.total() / kB, 141, 0.5);
  EXPECT_NEAR(c.active() / kB, 39, 0.5);
}

// docs/plan.md's parameter table, the planner's columns (printed to 0.01B).
TEST(PlanParams, PlannerFiguresOfDocsPlanMd) {
  struct Row {
    const char* cfg;
    const char* total;
    const char* active;
    const char* line;  // the row of the table, up to the active count
  };
  for (const Row& r : std::vector<Row>{
           {"qwen3-235b-a22b", "235.09", "22.19", "| Qwen3-235B-A22B | 235.09B | 235B | 22.19B |"},
           {"qwen3-30b-a3b", "30.53", "3.35", "| Qwen3-30B-A3B | 30.53B | 30.5B | 3.35B |"},
           {"mixtral-8x7b", "46.70", "12.88", "| Mixtral-8x7B | 46.70B | 46.7B | 12.88B |"},
           {"mixtral-8x22b", "140.62", "39.15", "| Mixtral-8x22B | 140.62B | 141B | 39.15B |"}}) {
    SCOPED_TRACE(r.cfg);
    const ParamCounts c = count_params(shipped(r.cfg));
    EXPECT_TRUE(documented(c.total() / kB, r.total, r.line));
    EXPECT_TRUE(documented(c.active() / kB, r.active, r.line));
  }
  const ParamCounts d = count_params(shipped("deepseek-v3"));
  const std::string line =
      "| DeepSeek-V3 | 671.03B (684.49B with the MTP module's own embedding and head) | 671B "
      "(685B) | 37.55B; 36.63B without the embedding |";
  EXPECT_TRUE(documented(d.total() / kB, "671.03", line));
  EXPECT_TRUE(documented((d.total_with_mtp() + d.embedding + d.head) / kB, "684.49", line));
  EXPECT_TRUE(documented(d.active() / kB, "37.55", line));
  EXPECT_TRUE(documented((d.active() - d.embedding) / kB, "36.63", line));
}

// A HuggingFace config.json gives the same model as the shipped Megatron flags.
TEST(PlanParams, HfConfigEqualsTheShippedFlags) {
  const std::string dir = ::testing::TempDir();
  const std::string mixtral = dir + "/mixtral_config.json";
  {
    std::ofstream f(mixtral);
    f << R"({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 32768, "tie_word_embeddings": false})";
  }
  EXPECT_EQ(count_params(spec_from_hf_config(mixtral)).total(),
            count_params(shipped("mixtral-8x7b")).total());
  const std::string dsv3 = dir + "/deepseek_v3_config.json";
  {
    std::ofstream f(dsv3);
    f << R"({"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
            "tie_word_embeddings": false})";
  }
  const ParamCounts hf = count_params(spec_from_hf_config(dsv3));
  const ParamCounts flags = count_params(shipped("deepseek-v3"));
  EXPECT_EQ(hf.total(), flags.total());
  EXPECT_EQ(hf.active(), flags.active());
  EXPECT_EQ(hf.total_with_mtp(), flags.total_with_mtp());
}

// The MoE layers and biases of transformers' Qwen-MoE configs (tests/fixtures/hf): layer l is
// sparse iff l is not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0; Qwen2-MoE
// attention has q/k/v biases.
TEST(PlanParams, HfQwenMoeLayersAndBiases) {
  const std::string hf = ::moecore::testing::source_dir() + "/tests/fixtures/hf/";
  const ModelSpec q2 = spec_from_hf_config(hf + "qwen2_moe/config.json");
  EXPECT_EQ(q2.moe_layer_pattern, (std::vector<int>{0, 1, 0, 1}));  // decoder_sparse_step 2
  EXPECT_TRUE(q2.add_qkv_bias);
  const ModelSpec q3 = spec_from_hf_config(hf + "qwen3_moe/config.json");
  EXPECT_EQ(q3.moe_layer_pattern, (std::vector<int>{1, 0, 1}));  // mlp_only_layers [1]
  EXPECT_FALSE(q3.add_qkv_bias);
  EXPECT_EQ(q3.num_experts, 8);
}

// The planner's count equals what the trainer registers for a model it builds.
TEST(PlanParams, EqualsTheTrainersRegistry) {
  const cli::TrainFlags f = cli::parse_train_args(cli::config_file_args(config("tiny")));
  const ArenaSizes a = trainer_arena_sizes(f.model, f.train.micro_batch, {}, 1, 0);
  EXPECT_EQ(a.numel_dense + a.numel_expert, count_params(shipped("tiny")).total());
  EXPECT_EQ(a.numel_expert, count_params(shipped("tiny")).experts());
}

// Megatron's default MLP (no --swiglu: F.gelu; no --disable-bias-linear: biases) and the other
// activation flags: fc1 is F wide, each MLP has F + H biases, and the count equals the registry
// of the model the trainer builds from the spec.
TEST(PlanParams, GeluWithBiasesEqualsTheTrainersRegistry) {
  const std::vector<std::string> base = {
      "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
      "16", "--vocab-size", "128", "--num-experts", "4", "--moe-ffn-hidden-size", "24",
      "--moe-shared-expert-intermediate-size", "16", "--moe-layer-freq", "[1,0]",
      "--ffn-hidden-size", "40", "--moe-router-topk", "2"};
  auto spec = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    const cli::ParsedArgs a =
        cli::parse_megatron_argv(args, {}, cli::moecore_extra_choices());
    ModelSpec m = model_from_args(a);
    pad_vocab(m, a, 1);
    return m;
  };
  const ModelSpec gelu = spec({});
  EXPECT_EQ(gelu.activation, ops::Activation::GeLU);
  EXPECT_TRUE(gelu.add_mlp_bias);
  // The rest of Megatron's default model: every linear layer's bias, LayerNorm, learned
  // positions (the registry comparison below counts their parameters too).
  EXPECT_TRUE(gelu.add_qkv_bias && gelu.add_attention_output_bias);
  EXPECT_TRUE(gelu.layernorm && gelu.learned_positions);
  EXPECT_EQ(count_params(gelu).final_norm, 2 * 32);
  // Without --vocab-size the synthetic language's 256 tokens, as the trainer; with data the
  // flag stays required.
  const std::vector<std::string> no_vocab = {"--num-layers", "2", "--hidden-size", "32",
                                             "--num-attention-heads", "4", "--seq-length", "16"};
  EXPECT_EQ(model_from_args(cli::parse_megatron_argv(no_vocab, {}, cli::moecore_extra_choices()))
                .vocab_unpadded,
            256);
  std::vector<std::string> mock = no_vocab;
  mock.push_back("--mock-data");
  EXPECT_THROW(model_from_args(cli::parse_megatron_argv(mock, {}, cli::moecore_extra_choices())),
               Error);
  EXPECT_EQ(spec({"--openai-gelu"}).activation, ops::Activation::GeLUTanh);
  EXPECT_EQ(spec({"--squared-relu"}).activation, ops::Activation::SquaredReLU);
  const ModelSpec swiglu = spec({"--swiglu", "--disable-bias-linear"});
  EXPECT_EQ(swiglu.activation, ops::Activation::SwiGLU);
  EXPECT_FALSE(swiglu.add_mlp_bias);

  const int64_t H = 32;
  const LayerParams moe = layer_params(gelu, true), dense = layer_params(gelu, false);
  EXPECT_EQ(moe.expert_one, (24 + 24) * H + 24 + H);
  EXPECT_EQ(moe.shared, (16 + 16) * H + 16 + H);
  EXPECT_EQ(dense.dense_mlp, (40 + 40) * H + 40 + H);
  EXPECT_EQ(layer_params(swiglu, true).expert_one, 3 * 24 * H);
  // Matmul parameters leave the biases out.
  const int64_t attn = 4 * H * H;
  EXPECT_EQ(layer_matmul_active(gelu, true), attn + 4 * H + 32 * H + 2 * 48 * H);
  EXPECT_EQ(layer_matmul_active(gelu, false), attn + 80 * H);

  for (const ModelSpec& m : {gelu, spec({"--swiglu"}), spec({"--squared-relu",
                                                             "--disable-bias-linear"})}) {
    SCOPED_TRACE(ops::activation_name(m.activation));
    const ModelConfig c = trainer_model_config(m, RunSpec{});
    EXPECT_EQ(c.activation, m.activation);
    EXPECT_EQ(c.add_mlp_bias, m.add_mlp_bias);
    const ArenaSizes a = trainer_arena_sizes(c, 1, {}, 1, 0);
    EXPECT_EQ(a.numel_dense + a.numel_expert, count_params(m).total());
    EXPECT_EQ(a.numel_expert, count_params(m).experts());
  }
}

// One rank: the planner's memory is the trainer's plan (StepMetrics::mem_bytes by kind and
// mem_planned_bytes, what "[train] memory plan (MiB)" prints), byte for byte, with and without
// --bf16 and recomputation, and with multi-latent attention (mla_up_proj too).
// The tiny model as Megatron builds it without its model-function flags (GeLU, biases,
// LayerNorm, learned positions, dropout 0.1): configs/tiny.toml without those keys.
std::string megatron_default_tiny_config() {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("moecore_plan_megatron_tiny." + std::to_string(::getpid()) + ".toml"))
                               .string();
  std::ifstream in(config("tiny"));
  std::ofstream out(path);
  for (std::string line; std::getline(in, line);) {
    bool model_function = false;
    for (const char* key : {"normalization", "position-embedding-type", "swiglu",
                            "disable-bias-linear", "attention-dropout", "hidden-dropout"})
      model_function |= line.rfind(std::string(key) + " =", 0) == 0;
    if (!model_function) out << line << "\n";
  }
  return path;
}

TEST(PlanMemory, OneRankEqualsTheTrainersPlan) {
  const std::vector<std::vector<std::string>> variants = {
      {},
      {"--bf16"},
      {"--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe_act"},
      {"--recompute-granularity", "full", "--recompute-method", "uniform",
       "--recompute-num-layers", "1"},
      {"megatron-model"},
      {"megatron-model", "--bf16", "--recompute-granularity", "selective", "--recompute-modules",
       "core_attn", "layernorm", "moe_act"},
      // Multi-latent attention, also with its own recomputation module.
      {"--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim",
       "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--bf16"},
      {"--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--recompute-granularity", "selective",
       "--recompute-modules", "core_attn", "mla_up_proj"}};
  const std::string megatron_config = megatron_default_tiny_config();
  for (auto extra : variants) {
    const bool megatron_model = !extra.empty() && extra[0] == "megatron-model";
    if (megatron_model) extra.erase(extra.begin());
    const std::string cfg = megatron_model ? megatron_config : config("tiny");
    SCOPED_TRACE(::testing::Message() << (megatron_model ? "Megatron's model " : "tiny model ")
                                      << extra.size() << " flags");
    std::vector<std::string> args = {"--config", cfg, "--train-iters", "1",
                                     "--lr-warmup-iters", "0", "--peak-tflops", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<std::string> v{"train"};
    v.insert(v.end(), args.begin(), args.end());
    v = cli::expand_config_files(v);
    v.erase(v.begin());
    const cli::TrainFlags f = cli::parse_train_args(v);
    train::Trainer trainer(f.model, f.train);
    const train::StepMetrics m = trainer.train_step();

    const ArenaSizes a = trainer_arena_sizes(f.model, f.train.micro_batch, {}, 1, 0);
    for (int k = 0; k < kNumMemKinds; ++k) {
      EXPECT_EQ(a.by_kind[k], static_cast<double>(m.mem_bytes[k]))
          << mem_kind_name(static_cast<MemKind>(k)) << " with " << extra.size() << " flags";
    }
    EXPECT_EQ(a.planned, static_cast<double>(m.mem_planned_bytes));
    EXPECT_EQ(a.sharing_saves, static_cast<double>(m.mem_shared_saved_bytes));
    EXPECT_EQ(a.recompute_saves, static_cast<double>(m.mem_recompute_saved_bytes));

    // And through the command: the stage's arena lines and its planned total.
    std::vector<std::string> pargs = {"--config", cfg, "--hardware", "cpu", "--json"};
    pargs.insert(pargs.end(), extra.begin(), extra.end());
    const auto j = nlohmann::json::parse(plan_out(pargs));
    const auto& st = j["stages"][0];
    EXPECT_EQ(st["source"], "arena");
    EXPECT_EQ(st["arena_planned_bytes"].get<double>(), static_cast<double>(m.mem_planned_bytes));
    EXPECT_EQ(st["memory_bytes"]["activations"].get<double>(),
              static_cast<double>(m.mem_bytes[static_cast<int>(MemKind::Activations)]));
    EXPECT_EQ(st["memory_bytes"]["weights"].get<double>(),
              static_cast<double>(m.mem_bytes[static_cast<int>(MemKind::Weights)]));
    EXPECT_EQ(j["memory_per_rank_bytes"]["total"].get<double>(),
              static_cast<double>(m.mem_planned_bytes));  // cpu: nothing reserved
  }
}

// --use-distributed-optimizer on 4 ranks (EP 1: dp = edp = 4; EP 2: edp 2; EP 4: edp 1), fp32
// and --bf16: the plan's stage is the trainer's sizing pass with the moments of this rank's
// shards of the trainer's buckets (no formula line), the weights and grads as without it (the
// trainer shards only Adam m, v: no second gradient buffer, the fp32 master values whole).
TEST(PlanMemory, DistributedOptimizerIsTheTrainersSharding) {
  for (const char* ep : {"1", "2", "4"}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "ep " << ep << (bf16 ? " bf16" : ""));
      std::vector<std::string> args = {"--config", config("tiny"), "--hardware", "cpu",
                                       "--gpus", "4", "--expert-model-parallel-size", ep,
                                       "--global-batch-size", "32", "--json"};
      if (bf16) args.push_back("--bf16");
      const auto plain = nlohmann::json::parse(plan_out(args));
      args.push_back("--use-distributed-optimizer");
      const auto dist = nlohmann::json::parse(plan_out(args));
      const auto& st = dist["stages"][0];
      ASSERT_EQ(st["source"], "arena");
      // --bf16: the fp32 master weights move from the weights into the optimizer's shards.
      for (const char* kind : {"grads", "activations"}) {
        EXPECT_EQ(st["memory_bytes"][kind].get<double>(),
                  plain["stages"][0]["memory_bytes"][kind].get<double>())
            << kind;
      }
      const double plain_weights = plain["stages"][0]["memory_bytes"]["weights"].get<double>();
      std::vector<std::string> v = {"train", "--config", config("tiny")};
      v = cli::expand_config_files(v);
      v.erase(v.begin());
      if (bf16) v.push_back("--bf16");
      const cli::TrainFlags f = cli::parse_train_args(v);
      parallel::ParallelConfig pc;
      pc.ep = std::stoi(ep);
      parallel::GradReduceConfig ddp;
      ddp.distributed_optimizer = true;
      const ArenaSizes a =
          trainer_arena_sizes(f.model, f.train.micro_batch, pc, 4, 0, Device::CPU, ddp);
      EXPECT_EQ(st["memory_bytes"]["optimizer"].get<double>(), a.by_kind[2]);
      EXPECT_EQ(st["arena_planned_bytes"].get<double>(), a.planned);
      EXPECT_EQ(a.shard_degree[0], 4);
      EXPECT_EQ(a.shard_degree[1], 4 / pc.ep);
      // Adam m, v (and under --bf16 the fp32 master) of about 1/d of each kind.
      const double whole = plain["stages"][0]["memory_bytes"]["optimizer"].get<double>();
      const double per = bf16 ? 12.0 : 8.0;
      const double want = per * (static_cast<double>(a.numel_dense) / 4 +
                                 static_cast<double>(a.numel_expert) / (4 / pc.ep));
      EXPECT_NEAR(a.by_kind[2], want, 0.01 * want);
      EXPECT_EQ(a.master_in_optimizer, bf16);
      const double weights = st["memory_bytes"]["weights"].get<double>();
      const double master_whole = 4.0 * static_cast<double>(a.numel_dense + a.numel_expert);
      EXPECT_NEAR(weights, bf16 ? plain_weights - master_whole : plain_weights, 2 * 64);
      EXPECT_LT(weights + a.by_kind[2], plain_weights + whole);
      // The MPI backend's scratch: its ring all-reduce and reduce-scatter hold two of the d
      // pieces of each bucket on every rank.
      const double grads = st["memory_bytes"]["grads"].get<double>();
      const double n = static_cast<double>(a.numel_dense + a.numel_expert);
      const double gd = grads * static_cast<double>(a.numel_dense) / n, ge = grads - gd;
      const int edp = 4 / pc.ep;
      for (const auto* j : {&plain, &dist}) {
        EXPECT_NEAR((*j)["stages"][0]["memory_bytes"]["comm_buffers"].get<double>(),
                    2.0 / 4 * gd + (edp > 1 ? 2.0 / edp * ge : 0), 1.0);
      }
    }
  }
}

// Expert parallelism, every rank of EP 2 x EDP 2 on 4 ranks: the sizing pass on sizing groups
// plans what the allocating model of that rank holds (the same groups, no MPI needed: neither
// communicates while it is built), and the EP ranks hold half the experts.
TEST(PlanMemory, ExpertParallelRanksEqualTheAllocatedModel) {
  const cli::TrainFlags f = cli::parse_train_args(cli::config_file_args(config("tiny")));
  parallel::ParallelConfig pc;
  pc.ep = 2;
  const parallel::Layout layout = parallel::make_layout(pc, 4);
  const ArenaSizes one = trainer_arena_sizes(f.model, f.train.micro_batch, {}, 1, 0);
  for (int rank = 0; rank < 4; ++rank) {
    auto groups = sizing_groups(layout, rank);
    model::GPTModel<float> model(f.model, f.train.micro_batch, 1, groups.get());
    ASSERT_TRUE(model.arena().allocated());
    const ArenaSizes a = trainer_arena_sizes(f.model, f.train.micro_batch, pc, 4, rank);
    for (int k = 0; k < kNumMemKinds; ++k) {
      const MemKind kind = static_cast<MemKind>(k);
      double want = static_cast<double>(model.arena().bytes_of(kind));
      if (kind == MemKind::OptimizerState) {  // + Adam m, v of each kind, 64-byte aligned
        auto up = [](int64_t n) { return static_cast<double>((n * 4 + 63) / 64 * 64); };
        want += 2 * up(model.params().numel(ParamKind::Dense)) +
                2 * up(model.params().numel(ParamKind::Expert));
      }
      EXPECT_EQ(a.by_kind[k], want) << "rank " << rank << " " << mem_kind_name(kind);
    }
    EXPECT_EQ(a.numel_expert * 2, one.numel_expert);
    EXPECT_EQ(a.numel_dense, one.numel_dense);
  }
}

// The sizing pass allocates nothing: Mixtral-8x22B (141B parameters, some 2.8 TB in the
// trainer's fp32 plan) sized on one rank leaves the resident set where it was.
TEST(PlanMemory, SizingPassAllocatesNothing) {
  const ModelSpec m = shipped("mixtral-8x22b");
  RunSpec run;
  run.bf16 = true;
  const int64_t before = peak_rss();
  const ArenaSizes a = trainer_arena_sizes(trainer_model_config(m, run), 1, {}, 1, 0);
  const int64_t after = peak_rss();
  EXPECT_GT(a.planned, 2e12);
  EXPECT_LT(after - before, int64_t{512} << 20);
}

// A GPU plan does not depend on the host's bf16 GEMM path: sized for CUDA, --bf16 has no
// widened weight copies and no f32 GEMM workspace whichever path this CPU took; sized for the
// CPU, the widen path holds both (the trainer's plan on such a CPU).
TEST(PlanMemory, GpuSizingIsTheSameOnEveryHost) {
  cli::TrainFlags f = cli::parse_train_args(cli::config_file_args(config("tiny")));
  f.model.bf16 = true;
  const std::vector<ops::Bf16GemmPath> paths =
      testing::runnable_bf16_gemm_paths({ops::Bf16GemmPath::Widen, ops::Bf16GemmPath::Native});
  std::vector<ArenaSizes> gpu, cpu;
  for (ops::Bf16GemmPath p : paths) {
    testing::ScopedBf16GemmPath scope(p);
    gpu.push_back(trainer_arena_sizes(f.model, f.train.micro_batch, {}, 1, 0, Device::CUDA));
    cpu.push_back(trainer_arena_sizes(f.model, f.train.micro_batch, {}, 1, 0, Device::CPU));
  }
  const int w = static_cast<int>(MemKind::Weights);
  const double numel = static_cast<double>(gpu[0].numel_dense + gpu[0].numel_expert);
  // CUDA: the fp32 master and its bf16 copy, and the f32 copies of the bf16 values f32 kernels
  // read (each kind's block 64-byte aligned).
  EXPECT_GT(gpu[0].numel_values32, 0);
  EXPECT_NEAR(gpu[0].by_kind[w], 6 * numel + 4.0 * static_cast<double>(gpu[0].numel_values32),
              6 * 64);
  // The CPU's widen path keeps the bf16 values widened to f32 instead (4 B, not 2), and plans
  // f32 GEMM workspace.
  EXPECT_NEAR(cpu[0].by_kind[w], 8 * numel, 4 * 64);
  EXPECT_GT(cpu[0].by_kind[static_cast<int>(MemKind::Workspace)],
            gpu[0].by_kind[static_cast<int>(MemKind::Workspace)]);
  for (size_t i = 1; i < paths.size(); ++i) {
    SCOPED_TRACE(ops::bf16_gemm_path_name(paths[i]));
    EXPECT_EQ(gpu[i].by_kind, gpu[0].by_kind);
    EXPECT_EQ(gpu[i].planned, gpu[0].planned);
    // The CPU's native path sizes as CUDA does.
    EXPECT_EQ(cpu[i].by_kind, gpu[0].by_kind);
  }
}

// Context parallelism in the formula (TP 2: the formula path): each rank holds S/cp positions,
// so a layer's activations halve from CP 1 to CP 2; the attention's K/V blocks (one layer at a
// time) are planned: the ring's four blocks of T = S/cp positions (K/V and dK/dV, current and
// next), or allgather's staging, global K/V and dK/dV (2.5 cp blocks).
TEST(PlanMemory, ContextParallelActivationsAndKvBlocks) {
  ModelSpec m = shipped("mixtral-8x7b");
  m.seq_length = 32768;
  m.max_position_embeddings = std::max(m.max_position_embeddings, m.seq_length);
  const Hardware hw = hardware_preset("h100");
  const auto plan = [&](int cp, const char* comm) {
    RunSpec r;
    r.bf16 = true;
    r.parallel.tp = 2;
    r.parallel.sequence_parallel = true;
    r.parallel.cp = cp;
    r.parallel.ep = 8;
    r.parallel.cp_comm_type = {comm};
    const StageMemory st = plan_memory(m, r, 16, hw).stages[0];
    EXPECT_FALSE(st.from_arena);
    return st;
  };
  const auto kv_line = [](const StageMemory& st) {
    for (const MemLine& l : st.lines)
      if (l.what.rfind("cp ", 0) == 0) return l.bytes;
    return 0.0;
  };
  const StageMemory one = plan(1, "p2p"), p2p = plan(2, "p2p"), p2p4 = plan(4, "p2p"),
                    gather4 = plan(4, "allgather");
  EXPECT_DOUBLE_EQ(p2p.act_layer_bytes * 2, one.act_layer_bytes);
  EXPECT_EQ(kv_line(one), 0.0);
  // K and V of the 8 query groups x 128 channels over TP 2, bf16, T = S/cp positions.
  const double kv_block = 32768.0 / 2 * 2 * 8 * 128 / 2 * 2;
  EXPECT_DOUBLE_EQ(kv_line(p2p), 4 * kv_block);
  EXPECT_DOUBLE_EQ(kv_line(p2p4), 4 * kv_block / 2);
  EXPECT_DOUBLE_EQ(kv_line(gather4), 2.5 * 4 * kv_block / 2);
}

// A CUDA plan counts the multi-block reductions' scratch (ops/cuda/reduce_workspace.h, one
// block for the trainer's one stream, outside the arena): a formula line of the workspace (so the
// stage's total counts it beside the arena's plan), on the formula path and on the trainer's
// planning pass alike; the same layout planned for the CPU has no such line.
TEST(PlanMemory, CudaPlansCountTheReductionsScratch) {
  const ModelSpec m = shipped("mixtral-8x7b");
  const auto scratch = [](const StageMemory& st) {
    double bytes = 0;
    for (const MemLine& l : st.lines) {
      if (l.what.rfind("reductions' scratch", 0) == 0) {
        EXPECT_EQ(l.part, MemPart::Workspace);
        EXPECT_FALSE(l.formula.empty());
        bytes += l.bytes;
      }
    }
    return bytes;
  };
  for (int tp : {1, 2}) {  // the trainer's pass (TP 1) and the formula path (TP 2)
    SCOPED_TRACE("tp " + std::to_string(tp));
    RunSpec r;
    r.bf16 = true;
    r.parallel.tp = tp;
    r.parallel.ep = 8;
    Hardware gpu = hardware_preset("h100"), cpu = gpu;
    cpu.device = Device::CPU;
    const StageMemory on_gpu = plan_memory(m, r, 8 * tp, gpu).stages[0];
    const StageMemory on_cpu = plan_memory(m, r, 8 * tp, cpu).stages[0];
    EXPECT_EQ(on_gpu.from_arena, tp == 1);
    EXPECT_EQ(scratch(on_gpu), double(ops::cuda::kReduceWorkspaceBytes));
    EXPECT_EQ(scratch(on_cpu), 0.0);
  }
}

// Context parallelism through the trainer's sizing pass (what `moecore plan` uses without TP):
// a CP rank plans S/cp positions, so its activations are about half of one rank's, and the
// attention's buffers across ranks (allgather's gathered K/V) are in its workspace.
TEST(PlanMemory, ContextParallelSizingPass) {
  const cli::TrainFlags f = cli::parse_train_args(cli::config_file_args(config("tiny")));
  const auto sizes = [&](int cp, const char* comm) {
    parallel::ParallelConfig pc;
    pc.cp = cp;
    pc.cp_comm_type = {comm};
    return trainer_arena_sizes(f.model, f.train.micro_batch, pc, cp, 0, Device::CPU);
  };
  const ArenaSizes one = sizes(1, "p2p"), p2p = sizes(2, "p2p"), gather = sizes(2, "allgather");
  const int act = static_cast<int>(MemKind::Activations);
  const int ws = static_cast<int>(MemKind::Workspace);
  EXPECT_NEAR(p2p.by_kind[act] * 2, one.by_kind[act], 0.05 * one.by_kind[act]);
  EXPECT_LT(p2p.by_kind[act], one.by_kind[act]);
  // The same parameters at every CP size (nothing is split by CP).
  EXPECT_EQ(p2p.numel_dense, one.numel_dense);
  EXPECT_EQ(p2p.numel_expert, one.numel_expert);
  // allgather's whole-sequence K/V: more workspace than the ring's blocks.
  EXPECT_GT(gather.by_kind[ws], p2p.by_kind[ws]);
}

TEST(PlanJson, KeysPresent) {
  for (const char* cfg : {"tiny", "deepseek-v3"}) {
    const auto j = nlohmann::json::parse(
        plan_out({"--config", config(cfg), "--expert-model-parallel-size", "8", "--gpus", "8",
                  "--micro-batch-size", "1", "--global-batch-size", "64", "--json"}));
    for (const char* key : {"params_total", "params_active", "memory_per_rank_bytes",
                            "alltoall_bytes_per_step", "flops_per_token", "tflops_per_gpu",
                            "step_seconds", "stages", "communication"}) {
      EXPECT_TRUE(j.contains(key)) << cfg << ": " << key;
    }
    for (const char* kind : {"weights", "grads", "optimizer", "activations", "workspace",
                             "comm_buffers", "reserved", "total"}) {
      EXPECT_TRUE(j["memory_per_rank_bytes"].contains(kind)) << cfg << ": " << kind;
    }
    EXPECT_GT(j["alltoall_bytes_per_step"].get<double>(), 0) << cfg;
  }
}

// The planner's FLOPs are the trainer's FLOPs model for the models the trainer builds.
TEST(PlanFlops, EqualsTheTrainersFlopsModel) {
  const cli::TrainFlags f = cli::parse_train_args(cli::config_file_args(config("tiny")));
  const train::FlopsModel t = train::flops_model(f.model);
  const PlanFlops p = plan_flops(shipped("tiny"), RunSpec{});
  EXPECT_DOUBLE_EQ(p.active_matmul_params, t.active_matmul_params);
  EXPECT_DOUBLE_EQ(p.attention_flops_per_token, t.attention_flops_per_token);
  // Multi-latent attention (with q LoRA and with linear_q_proj): the planner's spec from the
  // same flags, and the trainer's model.
  for (const std::vector<std::string>& q : {std::vector<std::string>{"--q-lora-rank", "24"},
                                           std::vector<std::string>{}}) {
    std::vector<std::string> args = cli::config_file_args(config("tiny"));
    for (const char* x : {"--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim",
                          "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12"})
      args.push_back(x);
    args.insert(args.end(), q.begin(), q.end());
    const cli::TrainFlags fm = cli::parse_train_args(args);
    ASSERT_TRUE(fm.model.multi_latent_attention);
    const train::FlopsModel tm = train::flops_model(fm.model);
    const ModelSpec spec =
        model_from_args(cli::parse_megatron_argv(args, {}, cli::moecore_extra_choices()));
    ASSERT_TRUE(spec.mla.has_value());
    const PlanFlops pm = plan_flops(spec, RunSpec{});
    EXPECT_DOUBLE_EQ(pm.active_matmul_params - spec.hidden * spec.vocab_size,
                     tm.active_matmul_params - f.model.hidden * fm.model.padded_vocab());
    EXPECT_DOUBLE_EQ(pm.attention_flops_per_token, tm.attention_flops_per_token);
    EXPECT_NE(tm.attention_flops_per_token, t.attention_flops_per_token);
  }
}

// The layouts NVIDIA publishes (docs/plan.md has the table and the sources) fit. Qwen3-30B-A3B's
// (TP 1, EP 8) is one the trainer builds, so its figure is the trainer's own plan, which does not
// fit an H100 today (fp32 activations, dropless worst-case EP buffers): docs/plan.md.
TEST(PlanPublished, PublishedLayoutsFit) {
  // What docs/plan.md prints for each: the worst stage's memory (GiB, 0.1), TFLOP/s per GPU,
  // and in its text the step's seconds: all-to-all (Qwen3), exposed communication of the whole
  // step (DeepSeek-V3), and TFLOP/s with every EP group on NVLink (--gpus-per-node 64).
  struct Case {
    const char* cfg;
    std::vector<std::string> flags;
    const char* gib;
    const char* tflops;
    const char* row;  // the table row, from the memory on
    // A JSON key or the start of a communication item's name, the seconds as printed, and the
    // line of docs/plan.md that prints them.
    std::vector<std::array<std::string, 3>> seconds;
  };
  const std::vector<Case> cases = {
      {"qwen3-235b-a22b",
       {"--hardware", "h100", "--gpus", "256", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--pipeline-model-parallel-size", "8",
        "--num-virtual-stages-per-pipeline-rank", "4", "--expert-model-parallel-size", "32",
        "--expert-tensor-parallel-size", "1", "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split", "--micro-batch-size", "1", "--global-batch-size",
        "2048", "--use-distributed-optimizer", "--recompute-granularity", "selective",
        "--recompute-modules", "layernorm", "moe_act"},
       "69.9",
       "210",
       "| 69.9 of 80 GiB (fits) | 210 |",
       {{"ep all-to-all", "15.6", "(the EP32 group spans 4 nodes; 15.6 s of all-to-all per step)"}}},
      {"deepseek-v3",
       {"--hardware", "gb200", "--gpus", "256", "--pipeline-model-parallel-size", "8",
        "--pipeline-model-parallel-layout", "Et|(tt|)*30mL", "--expert-model-parallel-size", "32",
        "--micro-batch-size", "1", "--global-batch-size", "2048", "--use-distributed-optimizer",
        "--recompute-granularity", "selective", "--recompute-modules", "mlp", "mla_up_proj",
        "--fp8-format", "e4m3", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
        "--exp-avg-sq-dtype", "bf16"},
       "150.5",
       "372",
       "| 150.5 of 186 GiB (fits) | 372 (1360 with `--gpus-per-node 64`) |",
       {{"ep all-to-all", "17.2", "so the all-to-all is priced on the network: 17.2 s"},
        {"exposed_comm_seconds", "17.8", "pipeline transfers 17.8 s of exposed communication"},
        {"step_seconds", "23.0", "exposed communication in a 23.0 s step"}}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"--config", config(c.cfg)};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    args.push_back("--json");
    const auto j = nlohmann::json::parse(plan_out(args));
    EXPECT_TRUE(j["fits"].get<bool>())
        << c.cfg << ": " << j["memory_per_rank_bytes"]["total"].get<double>() / (1 << 30)
        << " GiB";
    SCOPED_TRACE(c.cfg);
    EXPECT_TRUE(documented(j["memory_per_rank_bytes"]["total"].get<double>() / (1 << 30), c.gib,
                           c.row));
    EXPECT_TRUE(documented(j["tflops_per_gpu"].get<double>(), c.tflops, c.row));
    for (const auto& [what, printed, line] : c.seconds) {
      double s = -1;
      if (j.contains(what)) s = j[what].get<double>();
      for (const auto& item : j["communication"]) {
        if (item["name"].get<std::string>().rfind(what, 0) == 0) s = item["seconds"].get<double>();
      }
      EXPECT_TRUE(documented(s, printed, line)) << what;
    }
  }
  // DeepSeek-V3 with 64 GPUs per NVLink domain: every EP group on NVLink.
  std::vector<std::string> nvl = {"--config", config("deepseek-v3"), "--gpus-per-node", "64"};
  nvl.insert(nvl.end(), cases[1].flags.begin(), cases[1].flags.end());
  nvl.push_back("--json");
  EXPECT_TRUE(documented(nlohmann::json::parse(plan_out(nvl))["tflops_per_gpu"].get<double>(),
                         "1360", cases[1].row));
}

// Qwen3-30B-A3B's published layout (TP 1, EP 8, distributed optimizer, 64 H100) is one the
// trainer builds. Dropless, its EP rows are planned for the worst case (EP x T x K) and it does
// not fit, and the plan says which flag bounds them; with a padded capacity factor 1 the rows
// are the balanced load and it fits, the fp32 master weights sharded with the Adam state as
// Megatron's distributed optimizer does (docs/parallel.md); dropless with
// --moe-expert-rank-capacity-factor 1.2 (20% headroom over the balanced load per EP rank) too
// (docs/plan.md).
TEST(PlanPublished, Qwen3_30B_PaddedCapacityFactorFits) {
  // The trainer's plan holds the CPU attention kernel's per-thread workspace: docs/plan.md's
  // figures are for one OpenMP thread.
  const testing::ScopedOmpThreads one_thread(1);
  const std::vector<std::string> layout = {"--config",
                                           config("qwen3-30b-a3b"),
                                           "--hardware",
                                           "h100",
                                           "--gpus",
                                           "64",
                                           "--expert-model-parallel-size",
                                           "8",
                                           "--micro-batch-size",
                                           "1",
                                           "--global-batch-size",
                                           "512",
                                           "--use-distributed-optimizer",
                                           "--recompute-granularity",
                                           "selective",
                                           "--recompute-modules",
                                           "layernorm",
                                           "moe_act",
                                           "--bf16",
                                           "--json"};
  const auto dropless = nlohmann::json::parse(plan_out(layout));
  std::vector<std::string> padded = layout;
  for (const char* f :
       {"--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"})
    padded.push_back(f);
  const auto cap = nlohmann::json::parse(plan_out(padded));
  EXPECT_FALSE(dropless["fits"].get<bool>());
  ASSERT_EQ(dropless["notes"].size(), 1u);
  EXPECT_NE(dropless["notes"][0].get<std::string>().find(
                "EP x T x K = 262144 rows per MoE layer, 8x the balanced load T x K = 32768"),
            std::string::npos)
      << dropless["notes"][0];
  EXPECT_TRUE(cap["fits"].get<bool>())
      << cap["memory_per_rank_bytes"]["total"].get<double>() / (1 << 30);
  EXPECT_TRUE(cap["notes"].empty());
  EXPECT_EQ(cap["stages"][0]["source"], "arena");
  EXPECT_LT(cap["memory_per_rank_bytes"]["total"].get<double>(),
            0.5 * dropless["memory_per_rank_bytes"]["total"].get<double>());

  std::vector<std::string> bounded = layout;
  for (const char* f : {"--moe-expert-rank-capacity-factor", "1.2"}) bounded.push_back(f);
  const auto rank_cap = nlohmann::json::parse(plan_out(bounded));
  EXPECT_TRUE(rank_cap["fits"].get<bool>())
      << rank_cap["memory_per_rank_bytes"]["total"].get<double>() / (1 << 30);
  EXPECT_TRUE(rank_cap["notes"].empty());
  // 1.2 x the balanced rows: above the padded factor 1's plan, far below the worst case.
  const double b = rank_cap["memory_per_rank_bytes"]["total"].get<double>();
  EXPECT_GT(b, cap["memory_per_rank_bytes"]["total"].get<double>());
  EXPECT_LT(b, 0.5 * dropless["memory_per_rank_bytes"]["total"].get<double>());

  // docs/plan.md's figures: the table row, and the padded plan by kind.
  std::vector<std::string> factor_15 = layout;
  for (const char* f : {"--moe-expert-rank-capacity-factor", "1.5"}) factor_15.push_back(f);
  const auto rank_cap_15 = nlohmann::json::parse(plan_out(factor_15));
  // Fits since the expert rows are bf16 (docs/design.md, "The MoE token path under --bf16").
  EXPECT_TRUE(rank_cap_15["fits"].get<bool>());
  auto gib = [](const nlohmann::json& j, const char* kind) {
    return j["memory_per_rank_bytes"][kind].get<double>() / (1 << 30);
  };
  const std::string row =
      "| the trainer's plan: 144.0 GiB dropless (does not fit); 61.9 GiB dropless with "
      "`--moe-expert-rank-capacity-factor 1.2` (65.5 at 1.5); 59.4 GiB with a padded capacity "
      "factor 1: all three fit | 621 |";
  EXPECT_TRUE(documented(gib(dropless, "total"), "144.0", row));
  EXPECT_TRUE(documented(gib(rank_cap, "total"), "61.9", row));
  EXPECT_TRUE(documented(gib(rank_cap_15, "total"), "65.5", row));
  EXPECT_TRUE(documented(gib(cap, "total"), "59.4", row));
  for (const auto* j : {&dropless, &cap, &rank_cap, &rank_cap_15}) {
    EXPECT_TRUE(documented((*j)["tflops_per_gpu"].get<double>(), "621", row));
  }
  const std::string kinds =
      "9.7 weights (the bf16 values, and f32 copies of the norms' and routers' bf16 values),\n"
      "  19.2 grads, 5.3 optimizer";
  EXPECT_TRUE(documented(gib(cap, "weights"), "9.7", kinds));
  // The bf16 values (2 B) beside the fp32 grads (4 B), and a little more (the f32 copies).
  EXPECT_GT(gib(cap, "weights"), 0.5 * gib(cap, "grads"));
  EXPECT_LT(gib(cap, "weights"), 0.51 * gib(cap, "grads"));
  EXPECT_TRUE(documented(gib(cap, "grads"), "19.2", kinds));
  EXPECT_TRUE(documented(gib(cap, "optimizer"), "5.3", kinds));
  const std::string kinds3 = "19.6 activations, 3.75 recomputed";
  EXPECT_TRUE(documented(gib(cap, "activations"), "19.6", kinds3));
  const std::string kinds2 = "3.75 recomputed, the workspace shared, 2 reserved";
  EXPECT_TRUE(documented(gib(cap, "recomputed"), "3.75", kinds2));
  EXPECT_TRUE(documented(gib(cap, "reserved"), "2", kinds2));
}

// --search: every layout it returns fits and `moecore groups` accepts it.
TEST(PlanSearch, ReturnsOnlyFittingLayoutsThatGroupsAccepts) {
  const auto j = nlohmann::json::parse(
      plan_out({"--config", config("tiny"), "--search", "--gpus", "4", "--hardware", "cpu",
                "--device-memory-gib", "0.03", "--top", "50", "--json"}));
  ASSERT_GT(j["layouts"].size(), 0u);
  EXPECT_GT(j["rejected"].get<int>(), 0);  // the memory limit rejects some
  for (const auto& l : j["layouts"]) {
    EXPECT_LE(l["memory_bytes"].get<double>(), 0.03 * (1 << 30));
    const std::string cmd = ::moecore::testing::moecore_binary() + " groups --world-size 4 " +
                            l["groups_flags"].get<std::string>() +
                            " --num-layers 2 --num-experts 8 --num-attention-heads 4 "
                            "--num-query-groups 4 --ffn-hidden-size 256 "
                            "--moe-ffn-hidden-size 64 --seq-length 64 > /dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  // The groups command's ranks match the planner's layouts' degrees.
  for (const auto& l : j["layouts"]) {
    EXPECT_EQ(l["tp"].get<int>() * l["cp"].get<int>() * l["dp"].get<int>() * l["pp"].get<int>(),
              4);
    EXPECT_EQ(l["etp"].get<int>() * l["ep"].get<int>() * l["edp"].get<int>() * l["pp"].get<int>(),
              4);
  }
}

}  // namespace
}  // namespace moecore::plan

namespace moecore::plan {
namespace {

// --print-schedule prints each pipeline rank's order (the runner's), with its warm-up and
// recomputed counts; the stage lines carry the same counts.
TEST(PlanPipeline, PrintsEachRanksSchedule) {
  const std::string out = plan_out({"--config", config("tiny"), "--pipeline-model-parallel-size",
                                    "2", "--num-virtual-stages-per-pipeline-rank", "2",
                                    "--num-layers", "4", "--global-batch-size", "32",
                                    "--hardware", "cpu", "--print-schedule"});
  EXPECT_NE(out.find("[plan] schedule of pp rank 0 (4 warm-up forwards, 8 recomputed): F0.0 F1.0 "
                     "F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("[plan] schedule of pp rank 1 (2 warm-up forwards, 4 recomputed)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("schedule: 2 warm-up forwards, micro-batches in flight per chunk [3 1], 4 "
                     "forwards recomputed"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("bubble (pp - 1) / (vp x M) = (2 - 1) / (2 x 4) = 0.125"), std::string::npos)
      << out;
}

}  // namespace
}  // namespace moecore::plan
