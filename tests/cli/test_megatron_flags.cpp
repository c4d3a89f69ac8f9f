// Megatron-LM's command lines: every flag of the table parses as its class says, the
// implemented flags have Megatron's defaults, argparse's semantics, docs/flags.md is current,
// and the MoE launch flags of Megatron's own recipes run unchanged (sizes shrunk, synthetic data).
#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/paths.h"
#include "common/run_config_fields.h"
#include "core/check.h"
#include "cli/config_file.h"
#include "cli/megatron_argv.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore::cli {
namespace {

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// A model small enough to parse and build in milliseconds, stated in full.
const std::string kBase =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16"
    " --max-position-embeddings 16 --num-experts 4 --moe-ffn-hidden-size 16 --vocab-size 64"
    " --normalization RMSNorm --position-embedding-type rope"
    " --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --train-iters 2 --lr 1e-3";

TrainFlags parse(const std::string& extra, const std::vector<std::string>& more = {}) {
  std::vector<std::string> args = words(kBase + " " + extra);
  args.insert(args.end(), more.begin(), more.end());
  return parse_train_args(args);
}

std::string error_of(const std::vector<std::string>& more) {
  try {
    parse("", more);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A value of the flag's type that differs from its default and from what moecore accepts.
bool changed_value(const MegatronFlag& f, std::vector<std::string>& out) {
  if (f.action != ArgAction::Store) {
    out = {f.name()};
    return true;
  }
  if (f.type == ArgType::Other) return false;
  const std::vector<std::string> accepted = accepted_values(f);
  auto is_accepted = [&](const std::string& v) {
    for (const std::string& a : accepted) {
      if (a == v) return true;
    }
    return false;
  };
  std::string v;
  if (!f.choices.empty()) {
    for (const std::string& c : f.choices) {
      if (!is_accepted(c) && c != default_text(f)) {
        v = c;
        break;
      }
    }
    if (v.empty()) return false;
  } else if (f.type == ArgType::Int) {
    v = f.default_value.is_number() ? std::to_string(f.default_value.get<int64_t>() + 3) : "3";
  } else if (f.type == ArgType::Float) {
    v = f.default_value.is_number() ? fmt::format("{}", f.default_value.get<double>() + 0.25)
                                    : "0.25";
  } else {
    v = "moecore-test-value";
  }
  const int n = f.nargs.empty() || f.nargs == "+" || f.nargs == "*" || f.nargs == "?"
                    ? 1
                    : std::stoi(f.nargs);
  out = {f.name()};
  for (int i = 0; i < n; ++i) out.push_back(v);
  return true;
}

TEST(MegatronFlags, TableIsMegatronsWithItsCommit) {
  const MegatronArguments& t = megatron_arguments();
  EXPECT_EQ(t.commit.size(), 40u);
  EXPECT_GT(t.flags.size(), 800u);
  const MegatronFlag* w = t.find("--lr-warmup-iters");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(default_text(*w), "0");
  EXPECT_NE(t.find("--no-position-embedding"), nullptr);
  EXPECT_NE(t.find("--moe-router-fusion"), nullptr);
  EXPECT_EQ(t.find("--fp32"), nullptr);  // moecore's own flag
}

// Each flag of the table: implemented ones parse with their default value; flags without
// effect parse with a notice; the others parse with their default and stop at any other value
// with "not implemented yet".
TEST(MegatronFlags, EveryFlagParsesAsItsClassSays) {
  int counts[3] = {0, 0, 0};
  for (const MegatronFlag& f : megatron_arguments().flags) {
    const FlagClass cls = flag_class(f, train_binds(f));
    ++counts[static_cast<int>(cls)];
    SCOPED_TRACE(f.name());
    std::vector<std::string> given;
    if (f.action == ArgAction::Store && !f.default_value.is_null() && f.type != ArgType::Other &&
        cls != FlagClass::NoEffect) {
      // Megatron's default, given explicitly, is fine for every class (TP 1, --optimizer adam).
      std::vector<std::string> with_default = {f.name()};
      for (const std::string& v : words(default_text(f))) with_default.push_back(v);
      bool fine = cls != FlagClass::NotYet;
      for (const std::string& a : accepted_values(f)) fine |= a == default_text(f);
      if (with_default.size() > 1 && fine) {
        EXPECT_EQ(error_of(with_default), "");
      }
    }
    if (!changed_value(f, given)) continue;
    // A switch moecore requires (--swiglu): giving it is the accepted value, the base model
    // gives it, and its absence is refused (ArgparseSemantics, test_cli).
    if (cls == FlagClass::NotYet && f.action != ArgAction::Store &&
        accepted_values(f).front() == (f.action == ArgAction::StoreTrue ? "true" : "false")) {
      continue;
    }
    if (cls == FlagClass::NoEffect) {
      TrainFlags t = parse("", given);
      bool noticed = false;
      for (const std::string& n : t.notices) noticed |= n.find(f.name()) != std::string::npos &&
                                                        n.find("without effect") != std::string::npos;
      EXPECT_TRUE(noticed);
    } else if (cls == FlagClass::NotYet) {
      const std::string e = error_of(given);
      EXPECT_NE(e.find(f.name()), std::string::npos) << e;
      EXPECT_NE(e.find("not implemented yet"), std::string::npos) << e;
    } else {
      // Implemented: another value is taken (validation may refuse it, never as unknown).
      const std::string e = error_of(given);
      EXPECT_EQ(e.find("unrecognized"), std::string::npos) << e;
      EXPECT_EQ(e.find("not implemented yet"), std::string::npos) << e;
    }
  }
  EXPECT_GT(counts[0], 60);
  EXPECT_GT(counts[1], 40);
}

// ---------------------------------------------------------------------------------------------
// Every bound flag reaches the configuration the run uses. A flag that is parsed and then
// ignored passes EveryFlagParsesAsItsClassSays; here each one, given a value other than its
// default, must change the field it binds in run_config_fields (the model, training and parallel
// configs train_command hands on), compared with the same command line without it. Covered: every
// flag the table marks implemented, moecore's own flags, and every value a not-yet flag accepts
// besides its default (--swiglu, --normalization RMSNorm, ...). A flag that changes nothing by
// design is listed with the reason; a deprecated spelling with Megatron's error.

// `context`: flags the value needs to be valid or to matter, given to the baseline too (a flag
// may appear there with another value: the last occurrence wins). The flag is tried under each
// of its names. `fields`: what the named run-config fields hold afterwards (numbers compare by
// value); each must differ from the baseline's.
struct FlagEffect {
  std::string flag;
  std::string context;
  std::string values;
  std::vector<std::pair<std::string, std::string>> fields;
};
struct FlagNoEffect {
  std::string flag;
  std::string values;
  std::string why;
};
struct FlagRefused {
  std::string flag;
  std::string values;
  std::string message;
};

bool same_text(const std::string& a, const std::string& b) {
  if (a == b) return true;
  char *ea = nullptr, *eb = nullptr;
  const double x = std::strtod(a.c_str(), &ea), y = std::strtod(b.c_str(), &eb);
  return !a.empty() && !b.empty() && *ea == '\0' && *eb == '\0' && x == y;
}

std::string fixture(const std::string& path) {
  return ::moecore::testing::source_dir() + "/tests/fixtures/" + path;
}

// A directory of this test's own, removed at the end of the scope.
class ScratchDir {
 public:
  ScratchDir() {
    std::string t = ::testing::TempDir() + "moecore_flags_XXXXXX";
    path_ = ::mkdtemp(t.data()) != nullptr ? t : "";
  }
  ~ScratchDir() {
    if (!path_.empty()) std::filesystem::remove_all(path_);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The flags whose effect must be shown: implemented Megatron flags, moecore's own, and the
// not-yet flags that accept a value besides their default.
std::set<std::string> flags_with_effect() {
  std::set<std::string> out;
  for (const MegatronFlag& f : megatron_arguments().flags) {
    const FlagClass cls = flag_class(f, train_binds(f));
    if (cls == FlagClass::Implemented) out.insert(f.name());
    if (cls != FlagClass::NotYet) continue;
    for (const std::string& a : accepted_values(f)) {
      if (!a.empty() && !same_text(a, default_text(f))) out.insert(f.name());
    }
  }
  TrainFlags flags;
  CLI::App app;
  add_train_flags(app, flags);
  for (const CLI::Option* o : app.get_options()) {
    if (o->get_lnames().empty() || o == app.get_help_ptr()) continue;
    const std::string name = "--" + o->get_lnames().front();
    if (megatron_arguments().find(name) == nullptr) out.insert(name);
  }
  return out;
}

std::vector<std::string> names_of(const std::string& flag) {
  const MegatronFlag* f = megatron_arguments().find(flag);
  return f != nullptr ? f->names : std::vector<std::string>{flag};
}

TEST(MegatronFlags, EveryBoundFlagReachesTheRunConfig) {
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path().empty());
  const std::string dir = scratch.path();
  // --use-checkpoint-args needs a checkpoint whose recorded flags hold a model flag the command
  // line does not give.
  const std::string ckpt = dir + "/ckpt";
  {
    TrainFlags f = parse("--qk-layernorm");
    f.train.peak_gflops = 100;  // no GEMM probe
    train::Trainer trainer(f.model, f.train);
    trainer.save_checkpoint(ckpt);
  }
  const std::string toml = dir + "/flags.toml";
  std::ofstream(toml) << "moe-router-topk = 3\n";
  const std::string tok = fixture("tokenizers/");
  const std::string gpt2 = " --mock-data --tokenizer-type GPT2BPETokenizer --vocab-file " + tok +
                           "gpt2-vocab.json --merge-file " + tok + "gpt2-merges.txt";

  const std::vector<FlagEffect> effects = {
      // Model.
      {"--num-layers", "", "4", {{"model.num_layers", "4"}}},
      {"--hidden-size", "", "64", {{"model.hidden", "64"}}},
      {"--num-attention-heads", "", "4", {{"model.num_heads", "4"}}},
      {"--group-query-attention", "", "", {{"model.num_query_groups", "1"}}},
      // Without --group-query-attention Megatron ignores it (query groups = heads).
      {"--num-query-groups", "--group-query-attention", "2", {{"model.num_query_groups", "2"}}},
      {"--ffn-hidden-size", "", "48", {{"model.ffn_hidden", "48"}}},
      {"--kv-channels", "", "8", {{"model.kv_channels", "8"}}},
      {"--seq-length", "", "8", {{"model.seq_length", "8"}}},
      {"--max-position-embeddings", "", "32", {{"model.max_position_embeddings", "32"}}},
      {"--rotary-base", "", "500000", {{"model.rotary_base", "500000"}}},
      {"--norm-epsilon", "", "1e-6", {{"model.norm_eps", "1e-6"}}},
      {"--init-method-std", "", "0.01", {{"model.init_std", "0.01"}}},
      {"--add-qkv-bias", "--disable-bias-linear", "", {{"model.add_qkv_bias", "true"}}},
      {"--add-attention-output-bias",
       "--disable-bias-linear",
       "",
       {{"model.add_attention_output_bias", "true"}}},
      {"--swiglu", "", "", {{"model.activation", "swiglu"}}},
      {"--openai-gelu", "", "", {{"model.activation", "openai_gelu"}}},
      {"--squared-relu", "", "", {{"model.activation", "squared_relu"}}},
      {"--disable-bias-linear",
       "",
       "",
       {{"model.add_mlp_bias", "false"}, {"model.add_qkv_bias", "false"}}},
      {"--normalization", "", "LayerNorm", {{"model.normalization", "LayerNorm"}}},
      {"--apply-layernorm-1p", "--normalization LayerNorm", "", {{"model.layernorm_1p", "true"}}},
      {"--position-embedding-type",
       "",
       "learned_absolute",
       {{"model.position_embedding", "learned_absolute"}}},
      {"--attention-dropout", "", "0.2", {{"model.attention_dropout", "0.2"}}},
      {"--hidden-dropout", "", "0.2", {{"model.hidden_dropout", "0.2"}}},
      {"--eod-mask-loss", "", "", {{"train.data.eod_mask_loss", "true"}}},
      {"--qk-layernorm", "", "", {{"model.qk_layernorm", "true"}}},
      // Multi-latent attention.
      {"--multi-latent-attention", "", "", {{"model.multi_latent_attention", "true"}}},
      {"--q-lora-rank", "", "16", {{"model.mla.q_lora_rank", "16"}}},
      {"--kv-lora-rank", "", "16", {{"model.mla.kv_lora_rank", "16"}}},
      {"--qk-head-dim", "", "16", {{"model.mla.qk_head_dim", "16"}}},
      {"--qk-pos-emb-head-dim", "", "8", {{"model.mla.qk_pos_emb_head_dim", "8"}}},
      {"--v-head-dim", "", "16", {{"model.mla.v_head_dim", "16"}}},
      {"--rope-type", "", "rope", {{"model.mla.rope_type", "rope"}}},
      {"--rotary-scaling-factor", "", "40", {{"model.mla.yarn.scaling_factor", "40"}}},
      {"--mscale", "", "0.707", {{"model.mla.yarn.mscale", "0.707"}}},
      {"--mscale-all-dim", "", "0.707", {{"model.mla.yarn.mscale_all_dim", "0.707"}}},
      {"--yarn-original-max-position-embeddings",
       "",
       "8192",
       {{"model.mla.yarn.original_max_position_embeddings", "8192"}}},
      {"--yarn-beta-fast", "", "16", {{"model.mla.yarn.beta_fast", "16"}}},
      {"--yarn-beta-slow", "", "2", {{"model.mla.yarn.beta_slow", "2"}}},
      {"--untie-embeddings-and-output-weights", "", "", {{"model.tie_embeddings", "false"}}},
      {"--mtp-num-layers", "", "2", {{"model.mtp_num_layers", "2"}}},
      {"--mtp-loss-scaling-factor", "", "0.3", {{"model.mtp_loss_scaling_factor", "0.3"}}},
      {"--vocab-size",
       "",
       "100",
       {{"train.data.synthetic_vocab", "100"}, {"model.vocab_size", "100"}}},
      {"--make-vocab-size-divisible-by", "", "32", {{"model.padded_vocab_size", "64"}}},
      {"--bf16", "", "", {{"model.bf16", "true"}}},
      {"--fp32-residual-connection", "", "", {{"model.fp32_residual_connection", "true"}}},
      // Mixture of experts.
      {"--num-experts",
       "",
       "8",
       {{"model.num_experts", "8"}, {"model.moe.router.num_experts", "8"}}},
      {"--moe-layer-freq", "", "2", {{"model.moe_layer_pattern", "1 0"}}},
      {"--moe-ffn-hidden-size", "", "8", {{"model.moe.ffn_hidden", "8"}}},
      {"--moe-shared-expert-intermediate-size", "", "16", {{"model.moe.shared_ffn_hidden", "16"}}},
      {"--moe-shared-expert-gate",
       "--moe-shared-expert-intermediate-size 16",
       "",
       {{"model.moe.shared_expert_gate", "true"}}},
      {"--moe-shared-expert-overlap",
       "--moe-shared-expert-intermediate-size 16 --moe-token-dispatcher-type alltoall",
       "",
       {{"model.moe.shared_expert_overlap", "true"}}},
      {"--moe-token-dispatcher-type", "", "alltoall", {{"model.moe.dispatcher_type", "alltoall"}}},
      {"--moe-expert-rank-capacity-factor",
       "",
       "1.25",
       {{"model.moe.expert_rank_capacity_factor", "1.25"}}},
      {"--moe-router-topk", "", "3", {{"model.moe.router.topk", "3"}}},
      {"--moe-router-score-function", "", "sigmoid", {{"model.moe.router.score", "sigmoid"}}},
      {"--moe-router-pre-softmax", "", "", {{"model.moe.router.pre_softmax", "true"}}},
      {"--moe-router-topk-scaling-factor",
       "",
       "2.5",
       {{"model.moe.router.topk_scaling_factor", "2.5"}}},
      {"--moe-router-load-balancing-type",
       "",
       "seq_aux_loss",
       {{"model.moe.router.load_balancing", "seq_aux_loss"}}},
      {"--moe-aux-loss-coeff", "", "0.01", {{"model.moe.router.aux_loss_coeff", "0.01"}}},
      {"--moe-z-loss-coeff", "", "0.001", {{"model.moe.router.z_loss_coeff", "0.001"}}},
      {"--moe-router-dtype", "", "fp64", {{"model.moe.router.dtype", "fp64"}}},
      {"--moe-input-jitter-eps", "", "0.01", {{"model.moe.router.input_jitter_eps", "0.01"}}},
      {"--moe-router-num-groups",
       "--moe-router-num-groups 1 --moe-router-group-topk 1",
       "2",
       {{"model.moe.router.num_groups", "2"}}},
      {"--moe-router-group-topk",
       "--moe-router-num-groups 2 --moe-router-group-topk 1",
       "2",
       {{"model.moe.router.group_topk", "2"}}},
      {"--moe-router-enable-expert-bias",
       "--moe-router-score-function sigmoid",
       "",
       {{"model.moe.router.enable_expert_bias", "true"}}},
      {"--moe-router-bias-update-rate",
       "",
       "0.01",
       {{"model.moe.router.bias_update_rate", "0.01"}}},
      {"--moe-router-quantile-balancing-ema",
       "",
       "0.5",
       {{"model.moe.router.quantile_ema", "0.5"}}},
      {"--moe-aux-loss-megatron-map", "", "", {{"model.moe.router.megatron_aux_map", "true"}}},
      {"--moe-expert-capacity-factor", "", "1.5", {{"model.moe.router.capacity_factor", "1.5"}}},
      {"--moe-pad-expert-input-to-capacity",
       "--moe-expert-capacity-factor 1",
       "",
       {{"model.moe.router.pad_to_capacity", "true"}}},
      {"--moe-token-drop-policy",
       "--moe-expert-capacity-factor 1",
       "position",
       {{"model.moe.router.drop_policy", "position"}}},
      // Recomputation.
      {"--recompute-granularity", "", "selective", {{"model.recompute.granularity", "selective"}}},
      {"--recompute-activations", "", "", {{"model.recompute.granularity", "selective"}}},
      {"--recompute-method",
       "--recompute-granularity full --recompute-num-layers 1 "
       "--recompute-method uniform",
       "block",
       {{"model.recompute.method", "block"}}},
      {"--recompute-num-layers",
       "--recompute-granularity full --recompute-method uniform "
       "--recompute-num-layers 1",
       "2",
       {{"model.recompute.num_layers", "2"}}},
      {"--recompute-modules",
       "--recompute-granularity selective",
       "moe layernorm",
       {{"model.recompute.module_names", "moe layernorm"}}},
      {"--moe-layer-recompute",
       "",
       "",
       {{"model.recompute.granularity", "selective"},
        {"model.recompute.module_names", "core_attn moe"}}},
      // Training, learning rate, optimizer.
      {"--micro-batch-size", "", "4", {{"train.micro_batch", "4"}}},
      {"--global-batch-size", "", "4", {{"train.global_batch", "4"}}},
      {"--train-iters", "", "5", {{"train.train_iters", "5"}, {"train.lr.decay_steps", "5"}}},
      {"--seed", "", "7", {{"train.seed", "7"}}},
      {"--log-interval", "", "5", {{"train.log_interval", "5"}}},
      {"--lr", "", "0.002", {{"train.lr.max_lr", "0.002"}}},
      {"--min-lr", "", "0.0001", {{"train.lr.min_lr", "0.0001"}}},
      {"--lr-warmup-iters", "", "1", {{"train.lr.warmup_steps", "1"}}},
      {"--lr-warmup-fraction", "--lr-decay-iters 10", "0.3", {{"train.lr.warmup_steps", "3"}}},
      {"--lr-warmup-init", "", "0.0001", {{"train.lr.warmup_init", "0.0001"}}},
      {"--lr-decay-iters", "", "10", {{"train.lr.decay_steps", "10"}}},
      {"--lr-decay-style", "", "cosine", {{"train.lr.style", "cosine"}}},
      {"--lr-wsd-decay-iters",
       "--lr-decay-style WSD --lr-wsd-decay-iters 1",
       "2",
       {{"train.lr.wsd_decay_steps", "2"}}},
      {"--lr-wsd-decay-style",
       "--lr-decay-style WSD --lr-wsd-decay-iters 1",
       "linear",
       {{"train.lr.wsd_style", "linear"}}},
      {"--weight-decay", "", "0.1", {{"train.adam.weight_decay", "0.1"}}},
      {"--clip-grad", "", "0.5", {{"train.adam.clip_grad", "0.5"}}},
      {"--adam-beta1", "", "0.8", {{"train.adam.beta1", "0.8"}}},
      {"--adam-beta2", "", "0.95", {{"train.adam.beta2", "0.95"}}},
      {"--adam-eps", "", "1e-6", {{"train.adam.eps", "1e-6"}}},
      // Numeric guards.
      {"--no-check-for-nan-in-loss-and-grad", "", "", {{"train.guard.check_nan", "false"}}},
      {"--check-for-nan-in-loss-and-grad", "", "", {}},  // the default
      {"--check-for-spiky-loss", "", "", {{"train.guard.check_spiky_loss", "true"}}},
      {"--check-for-large-grads", "", "", {{"train.guard.check_large_grads", "true"}}},
      {"--skip-spiky-steps",
       "--check-for-spiky-loss",
       "",
       {{"train.guard.skip_spiky_steps", "true"}}},
      {"--spike-check-samples", "", "7", {{"train.guard.samples", "7"}}},
      {"--iterations-to-skip", "", "3 5", {{"train.iterations_to_skip", "3 5"}}},
      // Data and validation.
      {"--data-path",
       "--vocab-size 256",
       fixture("data/preprocess_bytelevel_text_document"),
       {{"train.data.data_path", fixture("data/preprocess_bytelevel_text_document")}}},
      {"--mock-data", "--vocab-size 256", "", {{"train.data.mock_data", "true"}}},
      {"--split", "--mock-data --vocab-size 256", "90,5,5", {{"train.data.split", "90,5,5"}}},
      {"--data-cache-path", "", dir + "/cache", {{"train.data.data_cache_path", dir + "/cache"}}},
      {"--tokenizer-type",
       "--mock-data --vocab-size 256",
       "NullTokenizer",
       {{"train.data.tokenizer.type", "NullTokenizer"}}},
      {"--tokenizer-model",
       " --mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model " + tok + "hf_gpt2",
       tok + "hf_qwen2",
       {{"train.data.tokenizer.tokenizer_model", tok + "hf_qwen2"}}},
      // One vocab.json and merges.txt in the fixtures: the value is the same file, spelled
      // through the directory's "." entry.
      {"--vocab-file",
       gpt2,
       tok + "./gpt2-vocab.json",
       {{"train.data.tokenizer.vocab_file", tok + "./gpt2-vocab.json"}}},
      {"--merge-file",
       gpt2,
       tok + "./gpt2-merges.txt",
       {{"train.data.tokenizer.merge_file", tok + "./gpt2-merges.txt"}}},
      {"--eval-interval", "", "5", {{"train.eval_interval", "5"}}},
      {"--eval-iters", "", "5", {{"train.eval_iters", "5"}}},
      // Checkpointing and exits.
      {"--save", "", dir + "/save", {{"train.ckpt.save", dir + "/save"}}},
      {"--save-interval", "--save " + dir + "/save", "5", {{"train.ckpt.save_interval", "5"}}},
      {"--load", "", dir + "/load", {{"train.ckpt.load", dir + "/load"}}},
      {"--finetune", "--load " + dir + "/load", "", {{"train.ckpt.finetune", "true"}}},
      {"--moe-use-upcycling", "--load " + dir + "/load", "", {{"train.ckpt.upcycling", "true"}}},
      {"--ckpt-step", "--load " + dir + "/load", "3", {{"train.ckpt.ckpt_step", "3"}}},
      {"--use-checkpoint-args",
       "--load " + ckpt,
       "",
       {{"train.ckpt.use_checkpoint_args", "true"}, {"model.qk_layernorm", "true"}}},
      {"--exit-on-missing-checkpoint",
       "--load " + dir + "/load",
       "",
       {{"train.ckpt.exit_on_missing_checkpoint", "true"}}},
      {"--async-save", "", "", {{"train.ckpt.async_save", "true"}}},
      {"--no-save-optim", "", "", {{"train.ckpt.save_optim", "false"}}},
      {"--no-load-optim", "", "", {{"train.ckpt.load_optim", "false"}}},
      {"--no-save-rng", "", "", {{"train.ckpt.save_rng", "false"}}},
      {"--no-load-rng", "", "", {{"train.ckpt.load_rng", "false"}}},
      {"--exit-interval", "", "3", {{"train.ckpt.exit_interval", "3"}}},
      {"--exit-duration-in-mins", "", "30", {{"train.ckpt.exit_duration_mins", "30"}}},
      {"--exit-signal-handler", "", "", {{"train.ckpt.exit_signal_handler", "true"}}},
      // Parallelism (one rank parses any layout; the ranks check it against the world).
      {"--expert-model-parallel-size", "", "2", {{"parallel.ep", "2"}}},
      {"--tensor-model-parallel-size", "", "2", {{"parallel.tp", "2"}}},
      {"--pipeline-model-parallel-size", "", "2", {{"parallel.pp", "2"}}},
      {"--context-parallel-size", "", "2", {{"parallel.cp", "2"}}},
      {"--cp-comm-type", "", "allgather", {{"parallel.cp_comm_type", "allgather"}}},
      {"--expert-tensor-parallel-size", "", "1", {{"parallel.etp", "1"}}},
      {"--use-tp-pp-dp-mapping", "", "", {{"parallel.use_tp_pp_dp_mapping", "true"}}},
      {"--distributed-timeout-minutes", "", "3", {{"parallel.timeout_minutes", "3"}}},
      {"--overlap-grad-reduce", "", "", {{"train.ddp.overlap", "true"}}},
      {"--use-distributed-optimizer", "", "", {{"train.ddp.distributed_optimizer", "true"}}},
      {"--overlap-param-gather",
       "--use-distributed-optimizer --overlap-grad-reduce",
       "",
       {{"train.ddp.overlap_param_gather", "true"}}},
      {"--ddp-bucket-size", "", "1000", {{"train.ddp.bucket_size", "1000"}}},
      // Pipeline placement (validated against the model when the process groups are built).
      {"--decoder-first-pipeline-num-layers", "", "2", {{"parallel.first_stage_layers", "2"}}},
      {"--decoder-last-pipeline-num-layers", "", "2", {{"parallel.last_stage_layers", "2"}}},
      {"--num-virtual-stages-per-pipeline-rank", "", "2", {{"parallel.vp_stages", "2"}}},
      {"--num-layers-per-virtual-pipeline-stage", "", "2", {{"parallel.layers_per_vp_stage", "2"}}},
      {"--microbatch-group-size-per-virtual-pipeline-stage",
       "",
       "4",
       {{"parallel.microbatch_group_size", "4"}}},
      {"--account-for-embedding-in-pipeline-split",
       "",
       "",
       {{"parallel.account_for_embedding", "true"}}},
      {"--account-for-loss-in-pipeline-split", "", "", {{"parallel.account_for_loss", "true"}}},
      {"--pipeline-model-parallel-layout", "", "Et|tL", {{"parallel.layout", "Et|tL"}}},
      // moecore's own.
      {"--config", "", toml, {{"model.moe.router.topk", "3"}}},
      {"--metrics-file", "", dir + "/m.jsonl", {{"train.metrics_file", dir + "/m.jsonl"}}},
      {"--peak-tflops", "", "2", {{"train.peak_gflops", "2000"}}},
      {"--device", "", "cuda", {{"train.device", "cuda"}}},
      {"--fp32-matmul-precision", "", "high", {{"train.fp32_matmul_precision", "high"}}},
      {"--sync-audit", "", "", {{"train.sync_audit", "true"}}},
      // CUDA graphs: the implementation, its warm-up, and the deprecated scope spellings that
      // Megatron's validate_args migrates to it.
      {"--cuda-graph-impl", "", "full_iteration", {{"train.cuda_graph_impl", "full_iteration"}}},
      {"--cuda-graph-warmup-steps", "", "2", {{"train.cuda_graph_warmup_steps", "2"}}},
      {"--cuda-graph-modules", "", "full_iteration", {{"train.cuda_graph_impl", "full_iteration"}}},
      {"--cuda-graph-scope", "", "full_iteration", {{"train.cuda_graph_impl", "full_iteration"}}},
  };
  const std::vector<FlagNoEffect> no_effect = {
      {"--sequence-parallel", "",
       "Megatron turns sequence parallelism off without tensor parallelism (TP 1 here), with a "
       "notice"},
      {"--fp32", "", "fp32 training is the default; --bf16 is the other precision"},
      {"--rotary-seq-len-interpolation-factor", "1", "a factor of 1 interpolates nothing"},
  };
  const std::vector<FlagRefused> refused = {
      {"--batch-size", "4", "use --micro-batch-size"},
      {"--model-parallel-size", "2", "use --tensor-model-parallel-size"},
      {"--checkpoint-activations", "", "use --recompute-activations"},
      // Megatron's deprecated switches for its per-layer implementations.
      {"--enable-cuda-graph", "",
       "--enable-cuda-graph (deprecated: Megatron reads it as --cuda-graph-impl local): "
       "per-layer CUDA graphs"},
      {"--external-cuda-graph", "",
       "--external-cuda-graph (deprecated: Megatron reads it as --cuda-graph-impl "
       "transformer_engine): per-layer CUDA graphs"},
  };

  // Each flag with an effect is listed exactly once, and nothing else is.
  const std::set<std::string> expected = flags_with_effect();
  std::map<std::string, int> listed;
  for (const FlagEffect& e : effects) ++listed[e.flag];
  for (const FlagNoEffect& e : no_effect) ++listed[e.flag];
  for (const FlagRefused& e : refused) ++listed[e.flag];
  for (const std::string& f : expected) {
    EXPECT_EQ(listed[f], 1) << f << ": list it once, in effects (the field it reaches), "
                            << "no_effect (why) or refused";
  }
  for (const auto& [f, n] : listed) {
    EXPECT_TRUE(expected.count(f)) << f << " is listed but binds nothing or has no effect to show";
  }
  EXPECT_GT(expected.size(), 100u);

  // The run config of kBase + context + given; a parse error fails the test, naming it.
  auto fields_of = [](const std::string& context, const std::vector<std::string>& given,
                      testing::RunConfigFields& out) {
    try {
      out = testing::run_config_fields(parse(context, given));
      return true;
    } catch (const std::exception& err) {
      ADD_FAILURE() << "parse error: " << err.what();
      return false;
    }
  };
  for (const FlagEffect& e : effects) {
    SCOPED_TRACE(e.flag + " " + e.values + (e.context.empty() ? "" : " after " + e.context));
    testing::RunConfigFields before, after;
    if (!fields_of(e.context, {}, before)) continue;
    for (const std::string& name : names_of(e.flag)) {
      SCOPED_TRACE(name);
      std::vector<std::string> given = {name};
      for (const std::string& v : words(e.values)) given.push_back(v);
      if (!fields_of(e.context, given, after)) continue;
      for (const auto& [field, want] : e.fields) {
        ASSERT_TRUE(after.count(field)) << field << " is not in run_config_fields";
        EXPECT_TRUE(same_text(after.at(field), want))
            << field << " is " << after.at(field) << ", not " << want << "; the flag changed: "
            << ::testing::PrintToString(testing::changed_fields(before, after));
        EXPECT_FALSE(same_text(before.at(field), want))
            << field << " is " << want << " without the flag too: give another value";
      }
    }
  }
  for (const FlagNoEffect& e : no_effect) {
    SCOPED_TRACE(e.flag + " " + e.values + ": " + e.why);
    std::vector<std::string> given = {e.flag};
    for (const std::string& v : words(e.values)) given.push_back(v);
    testing::RunConfigFields before, after;
    if (!fields_of("", {}, before) || !fields_of("", given, after)) continue;
    EXPECT_EQ(testing::changed_fields(before, after), std::vector<std::string>{})
        << "listed as without effect, but it changes the run: move it to the effects";
  }
  for (const FlagRefused& e : refused) {
    std::vector<std::string> given = {e.flag};
    for (const std::string& v : words(e.values)) given.push_back(v);
    const std::string msg = error_of(given);
    EXPECT_NE(msg.find(e.message), std::string::npos) << e.flag << ": " << msg;
  }
}

// --config FILE: the file's values reach the run's configuration (keys with dashes or
// underscores, switches, lists), and the command line overrides the file.
TEST(ConfigFile, ValuesReachTheRunConfigAndTheCommandLineWins) {
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path().empty());
  const std::string toml = scratch.path() + "/run.toml";
  std::ofstream(toml) << "moe-router-topk = 3\n"  // only in the file
                         "adam_beta2 = 0.95\n"
                         "untie-embeddings-and-output-weights = true\n"
                         "qk-layernorm = false\n"  // a switch set false: not given
                         "moe-router-load-balancing-type = [\"aux_loss\", \"seq_aux_loss\"]\n"
                         "moe-aux-loss-coeff = [0.01, 0.001]\n"
                         "lr-decay-style = \"cosine\"\n"
                         "train-iters = 5\n"  // kBase gives --train-iters 2 and --lr 1e-3
                         "lr = 0.01\n";
  const testing::RunConfigFields from_file =
      testing::run_config_fields(parse("", {"--config", toml}));
  const std::vector<std::pair<std::string, std::string>> want = {
      {"model.moe.router.topk", "3"},
      {"train.adam.beta2", "0.95"},
      {"model.tie_embeddings", "false"},
      {"model.qk_layernorm", "false"},
      {"model.moe.router.load_balancing", "aux_loss"},
      {"model.moe.router.aux_loss_coeff", "0.01"},
      {"model.moe.router.extra_load_balancing", "seq_aux_loss:0.001"},
      {"train.lr.style", "cosine"},
      {"train.train_iters", "2"},  // the command line's
      {"train.lr.max_lr", "0.001"},
  };
  for (const auto& [field, value] : want) {
    EXPECT_TRUE(same_text(from_file.at(field), value))
        << field << " is " << from_file.at(field) << ", not " << value;
  }
  // The same as the flags given on the command line before kBase's.
  const std::vector<std::string> args = words(
      "--moe-router-topk 3 --adam-beta2 0.95 --untie-embeddings-and-output-weights"
      " --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001"
      " --lr-decay-style cosine --train-iters 5 --lr 0.01 " + kBase);
  EXPECT_EQ(testing::changed_fields(testing::run_config_fields(parse_train_args(args)), from_file),
            std::vector<std::string>{});
  // A --config=FILE spelling, and the flag after the command line's: the file still comes first.
  const std::vector<std::string> eq = words(kBase + " --config=" + toml);
  EXPECT_EQ(testing::changed_fields(testing::run_config_fields(parse_train_args(eq)), from_file),
            std::vector<std::string>{});
}

// configs/tiny.toml, the default run: every key is used. Dropping a key either stops the parse
// (a flag Megatron or moecore requires), or changes the run's configuration, or restates
// Megatron's default (then nothing changes), or is a flag accepted without effect.
TEST(ConfigFile, EveryKeyOfTinyTomlIsUsed) {
  const std::vector<std::string> all =
      config_file_args(::moecore::testing::source_dir() + "/configs/tiny.toml");
  // The file as flags, one group per key: "--key" and its values.
  std::vector<std::vector<std::string>> keys;
  for (const std::string& a : all) {
    if (a.rfind("--", 0) == 0) keys.emplace_back();
    keys.back().push_back(a);
  }
  ASSERT_GT(keys.size(), 30u);
  testing::RunConfigFields full;
  ASSERT_NO_THROW(full = testing::run_config_fields(parse_train_args(all)));
  int required = 0, changed = 0, restated = 0, without_effect = 0;
  for (size_t k = 0; k < keys.size(); ++k) {
    const std::string& flag = keys[k][0];
    SCOPED_TRACE(flag);
    std::vector<std::string> rest;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i != k) rest.insert(rest.end(), keys[i].begin(), keys[i].end());
    }
    const MegatronFlag* mf = megatron_arguments().find(flag);
    std::string value;
    for (size_t i = 1; i < keys[k].size(); ++i) value += (i > 1 ? " " : "") + keys[k][i];
    if (keys[k].size() == 1) value = "true";
    // moecore's one default where Megatron has None: the synthetic language's 256 tokens.
    const bool moecore_default = flag == "--vocab-size" && value == "256";
    const bool is_default =
        moecore_default ||
        (mf != nullptr && same_text(value, mf->action == ArgAction::StoreFalse
                                               ? (default_text(*mf) == "true" ? "false" : "true")
                                               : default_text(*mf)));
    const bool no_effect = mf != nullptr && flag_class(*mf, train_binds(*mf)) == FlagClass::NoEffect;
    testing::RunConfigFields dropped;
    try {
      dropped = testing::run_config_fields(parse_train_args(rest));
    } catch (const std::exception&) {
      ++required;
      continue;
    }
    const std::vector<std::string> diff = testing::changed_fields(full, dropped);
    if (is_default || no_effect) {
      EXPECT_EQ(diff, std::vector<std::string>{})
          << flag << " " << value << (is_default ? " is Megatron's default" : " has no effect")
          << ", yet dropping it changes the run";
      ++(is_default ? restated : without_effect);
    } else {
      EXPECT_NE(diff, std::vector<std::string>{})
          << flag << " " << value << " (not the default) changes nothing: the value is ignored";
      ++changed;
    }
  }
  EXPECT_GT(required, 5);
  EXPECT_GT(changed, 5);
  EXPECT_GT(restated, 0);
  EXPECT_GT(without_effect, 0);
}

// Megatron's default as moecore's text for the CLI11 default: numbers by value, lists without
// brackets, a store_false flag's field inverted.
std::string normalized(std::string s) {
  std::string out;
  for (char c : s) {
    if (c != '[' && c != ']' && c != '"') out += c == ',' ? ' ' : c;
  }
  char* end = nullptr;
  const double v = std::strtod(out.c_str(), &end);
  if (!out.empty() && *end == '\0') return fmt::format("{}", v);
  return out;
}

TEST(MegatronFlags, ImplementedFlagsHaveMegatronsDefaults) {
  TrainFlags flags;
  CLI::App app;
  add_train_flags(app, flags);
  int compared = 0;
  for (const MegatronFlag& f : megatron_arguments().flags) {
    if (flag_class(f, train_binds(f)) != FlagClass::Implemented) continue;
    SCOPED_TRACE(f.name());
    const CLI::Option* o = app.get_option_no_throw(f.name());
    ASSERT_NE(o, nullptr);
    if (f.default_value.is_null()) {
      EXPECT_EQ(o->get_default_str(), "");  // None: unset, resolved by Megatron's rules
      continue;
    }
    std::string expected = default_text(f);
    if (f.action == ArgAction::StoreFalse) expected = expected == "true" ? "false" : "true";
    EXPECT_EQ(normalized(o->get_default_str()), normalized(expected));
    ++compared;
  }
  EXPECT_GT(compared, 30);
}

// Megatron's CUDA graph flags: full_iteration (and its deprecated spellings, migrated as
// validate_args does) is taken; the per-layer implementations and what Megatron refuses of the
// combinations stop before anything is built, naming the flag and the fix.
TEST(MegatronFlags, CudaGraphFlagsMigrateAsMegatronsAndRefuseThePerLayerGraphs) {
  EXPECT_EQ(parse("").train.cuda_graph_impl, "none");
  EXPECT_EQ(parse("").train.cuda_graph_warmup_steps, 3);
  for (const char* spelling :
       {"--cuda-graph-impl full_iteration", "--cuda-graph-modules full_iteration",
        "--cuda-graph-scope full_iteration",
        "--enable-cuda-graph --cuda-graph-scope full_iteration",
        "--cuda-graph-impl local --cuda-graph-modules full_iteration",
        "--cuda-graph-impl full_iteration --cuda-graph-modules full"}) {
    SCOPED_TRACE(spelling);
    EXPECT_EQ(parse(spelling).train.cuda_graph_impl, "full_iteration");
  }
  EXPECT_EQ(parse("--cuda-graph-modules full").train.cuda_graph_impl, "none");
  const TrainFlags inference = parse("--cuda-graph-modules full_iteration_inference");
  EXPECT_EQ(inference.train.cuda_graph_impl, "none");
  std::string notices;
  for (const std::string& n : inference.notices) notices += n + "\n";
  EXPECT_NE(notices.find("full_iteration_inference: an inference graph scope"), std::string::npos)
      << notices;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--cuda-graph-impl local",
       "--cuda-graph-impl local: per-layer CUDA graphs (Megatron's MCore implementation) are not "
       "implemented; moecore captures a whole step's forward and backward as one graph: use "
       "--cuda-graph-impl full_iteration"},
      {"--cuda-graph-impl transformer_engine",
       "--cuda-graph-impl transformer_engine: per-layer CUDA graphs (Megatron's Transformer "
       "Engine implementation) are not implemented"},
      {"--cuda-graph-impl full_iteration --cuda-graph-modules attn mlp",
       "--cuda-graph-modules attn mlp with --cuda-graph-impl full_iteration: Megatron requires it "
       "empty"},
      {"--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 0",
       "--cuda-graph-warmup-steps 0: at least 1 eager step must come before the capture"},
      {"--enable-cuda-graph --cuda-graph-impl full_iteration",
       "--enable-cuda-graph (deprecated) and --cuda-graph-impl full_iteration are both given"},
      {"--cuda-graph-scope full_iteration --cuda-graph-modules attn",
       "--cuda-graph-scope (deprecated) and --cuda-graph-modules are both given"},
      {"--cuda-graph-impl transformer_engine --cuda-graph-modules full_iteration",
       "--cuda-graph-modules full_iteration cannot be combined with --cuda-graph-impl "
       "transformer_engine"},
      {"--cuda-graph-modules full attn", "--cuda-graph-modules full cannot be used with other"},
  };
  for (const auto& [flags, want] : refused) {
    const std::string msg = error_of(words(flags));
    EXPECT_NE(msg.find(want), std::string::npos) << flags << ": " << msg;
  }
}

TEST(MegatronFlags, ArgparseSemantics) {
  // The last occurrence wins, lists too; --flag=value; negative numbers are values.
  TrainFlags f = parse("--moe-aux-loss-coeff 1e-2 --moe-aux-loss-coeff 0 --moe-router-topk=3"
                       " --moe-expert-capacity-factor -1 --moe-router-load-balancing-type"
                       " aux_loss seq_aux_loss --moe-router-load-balancing-type aux_loss");
  EXPECT_DOUBLE_EQ(f.model.moe.router.aux_loss_coeff, 0.0);
  EXPECT_EQ(f.model.moe.router.topk, 3);
  EXPECT_TRUE(f.model.moe.router.dropless());
  EXPECT_TRUE(f.model.moe.router.extra_load_balancing.empty());
  // No abbreviations; an unknown flag names Megatron's nearest.
  EXPECT_NE(error_of({"--hidden", "32"}).find("nearest Megatron flag is --hidden-size"),
            std::string::npos);
  EXPECT_NE(error_of({"--moe-router-topk"}).find("expected one argument"), std::string::npos);
  EXPECT_NE(error_of({"--moe-router-topk", "two"}).find("invalid int value: 'two'"),
            std::string::npos);
  EXPECT_NE(error_of({"--lr-decay-style", "cosin"}).find("invalid choice: 'cosin'"),
            std::string::npos);
  EXPECT_NE(error_of({"--swiglu=1"}).find("ignored explicit argument"), std::string::npos);
  // A store_true / store_false pair and an on/off pair share a dest: the last one wins.
  ParsedArgs p = parse_megatron_argv(
      {"--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int",
       "--no-rl-skip-bos-token", "--rl-skip-bos-token"},
      {});
  ASSERT_EQ(p.flags.size(), 2u);
  EXPECT_EQ(p.flags[0].name, "--no-yarn-correction-range-round-to-int");
  EXPECT_EQ(p.flags[1].value_text(), "true");
  // Megatron's defaults: no warmup, so --train-iters 10 alone trains.
  TrainFlags d = parse("--train-iters 10");
  EXPECT_EQ(d.train.lr.warmup_steps, 0);
  EXPECT_EQ(d.train.lr.decay_steps, 10);
  EXPECT_EQ(d.train.lr.style, optim::LrDecayStyle::Linear);
  EXPECT_EQ(d.model.ffn_hidden, 4 * 32);  // the GeLU MLP's 4 h
  EXPECT_EQ(parse("--swiglu").model.ffn_hidden, (4 * 32 * 2 / 3) / 64 * 64);  // SwiGLU's 2/3 of 4 h
  EXPECT_EQ(d.model.moe.dispatcher_type, DispatcherType::AllGather);
  // Required flags, as Megatron requires them.
  EXPECT_NE(error_of({"--lr"}).find("expected one argument"), std::string::npos);
  try {
    parse_train_args(words("--num-layers 2"));
    ADD_FAILURE() << "parsed without --hidden-size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--hidden-size is required"), std::string::npos)
        << e.what();
  }
}

// One of Megatron's choices that an implemented flag does not take yet: "not implemented yet",
// naming the implemented choices; a value Megatron does not have stays argparse's error.
TEST(MegatronFlags, UnimplementedChoicesOfImplementedFlagsSayNotYet) {
  const std::string e = error_of({"--lr-decay-style", "inverse-square-root"});
  EXPECT_NE(e.find("--lr-decay-style inverse-square-root: Megatron's choice is not implemented "
                   "yet; moecore implements constant, linear, cosine, WSD"),
            std::string::npos)
      << e;
  EXPECT_NE(error_of({"--lr-decay-style", "sawtooth"}).find("invalid choice"), std::string::npos);
}

// Megatron's validate_args: --overlap-param-gather only with the distributed optimizer and
// --overlap-grad-reduce; the message names both flags and what was given.
TEST(MegatronFlags, OverlapParamGatherNeedsDistributedOptimizerAndGradOverlap) {
  for (const std::vector<std::string>& given :
       {std::vector<std::string>{"--overlap-param-gather"},
        {"--overlap-param-gather", "--overlap-grad-reduce"},
        {"--overlap-param-gather", "--use-distributed-optimizer"}}) {
    const std::string msg = error_of(given);
    EXPECT_NE(msg.find("--overlap-param-gather needs --use-distributed-optimizer and "
                       "--overlap-grad-reduce"),
              std::string::npos)
        << ::testing::PrintToString(given) << ": " << msg;
  }
  EXPECT_EQ(error_of({"--overlap-param-gather", "--use-distributed-optimizer",
                      "--overlap-grad-reduce"}),
            "");
}

TEST(MegatronFlags, DeprecatedSpellingsBehaveAsInMegatron) {
  EXPECT_NE(error_of({"--checkpoint-activations"}).find("use --recompute-activations"),
            std::string::npos);
  EXPECT_NE(error_of({"--batch-size", "4"}).find("use --micro-batch-size"), std::string::npos);
  TrainFlags r = parse("--recompute-granularity full --recompute-activations");
  EXPECT_EQ(r.model.recompute.granularity, RecomputeGranularity::Selective);
  TrainFlags m = parse("--moe-layer-recompute");
  EXPECT_EQ(m.model.recompute.granularity, RecomputeGranularity::Selective);
  EXPECT_EQ(m.model.recompute.module_names, (std::vector<std::string>{"core_attn", "moe"}));
  EXPECT_NE(error_of({"--moe-layer-recompute", "--recompute-granularity", "full",
                      "--recompute-method", "uniform", "--recompute-num-layers", "1"})
                .find("full recompute granularity"),
            std::string::npos);
}

// --moe-shared-expert-gate is Megatron's, --add-attention-output-bias moecore's own: both bind
// to the model config, are off by default, and the gate needs a shared expert.
TEST(MegatronFlags, SharedExpertGateAndAttentionOutputBias) {
  const TrainFlags off = parse("--disable-bias-linear --moe-shared-expert-intermediate-size 16");
  EXPECT_FALSE(off.model.moe.shared_expert_gate);
  EXPECT_FALSE(off.model.add_attention_output_bias);
  const MegatronFlag* gate = megatron_arguments().find("--moe-shared-expert-gate");
  ASSERT_NE(gate, nullptr);
  EXPECT_EQ(flag_class(*gate, train_binds(*gate)), FlagClass::Implemented);
  EXPECT_EQ(megatron_arguments().find("--add-attention-output-bias"), nullptr);  // moecore's own
  const TrainFlags on = parse(
      "--moe-shared-expert-intermediate-size 16 --moe-shared-expert-gate --add-qkv-bias"
      " --add-attention-output-bias");
  EXPECT_TRUE(on.model.moe.shared_expert_gate);
  EXPECT_TRUE(on.model.add_attention_output_bias);
  EXPECT_TRUE(on.model.add_qkv_bias);
  const std::string e = error_of({"--moe-shared-expert-gate"});
  EXPECT_NE(e.find("--moe-shared-expert-gate"), std::string::npos) << e;
  EXPECT_NE(e.find("--moe-shared-expert-intermediate-size"), std::string::npos) << e;
  EXPECT_NE(train_help().find("--add-attention-output-bias"), std::string::npos);
}

// --moe-shared-expert-overlap is implemented (no longer a flag without effect): it binds with a
// shared expert and the alltoall dispatcher; beside the allgather dispatcher with a shared
// expert it stops before training, naming both values and the fix (Megatron's TransformerConfig
// refuses the pair too); without a shared expert, or at EP 1, it is accepted with a notice that
// it changes nothing.
TEST(MegatronFlags, SharedExpertOverlap) {
  const MegatronFlag* flag = megatron_arguments().find("--moe-shared-expert-overlap");
  ASSERT_NE(flag, nullptr);
  EXPECT_EQ(flag_class(*flag, train_binds(*flag)), FlagClass::Implemented);
  const std::string shared = " --moe-shared-expert-intermediate-size 16";
  EXPECT_FALSE(parse(shared).model.moe.shared_expert_overlap);
  const TrainFlags on = parse(
      "--moe-token-dispatcher-type alltoall --moe-shared-expert-overlap"
      " --expert-model-parallel-size 2" +
      shared);
  EXPECT_TRUE(on.model.moe.shared_expert_overlap);
  for (const std::string& n : on.notices) {
    EXPECT_EQ(n.find("--moe-shared-expert-overlap"), std::string::npos) << n;
  }
  const std::string e =
      error_of(words("--moe-token-dispatcher-type allgather --moe-shared-expert-overlap" + shared));
  EXPECT_NE(e.find("[moe] --moe-shared-expert-overlap computes the shared expert (width 16)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--moe-token-dispatcher-type allgather has none"), std::string::npos) << e;
  EXPECT_NE(e.find("give --moe-token-dispatcher-type alltoall"), std::string::npos) << e;
  // Megatron's default dispatcher is allgather: the flag alone with a shared expert stops too.
  EXPECT_NE(error_of(words("--moe-shared-expert-overlap" + shared)).find("allgather has none"),
            std::string::npos);
  auto notice = [](const TrainFlags& t) {
    std::string all;
    for (const std::string& n : t.notices) {
      if (n.find("--moe-shared-expert-overlap") != std::string::npos) all += n;
    }
    return all;
  };
  EXPECT_NE(notice(parse("--moe-shared-expert-overlap")).find("no shared expert"),
            std::string::npos);
  EXPECT_NE(notice(parse("--moe-shared-expert-overlap --moe-token-dispatcher-type alltoall" +
                         shared))
                .find("--expert-model-parallel-size 1"),
            std::string::npos);
}

// --moe-expert-rank-capacity-factor binds (Megatron's None: unset), and what cannot work stops
// before training: a factor below the balanced load, a factor beside padded dispatch.
TEST(MegatronFlags, ExpertRankCapacityFactor) {
  const MegatronFlag* flag = megatron_arguments().find("--moe-expert-rank-capacity-factor");
  ASSERT_NE(flag, nullptr);
  EXPECT_EQ(flag_class(*flag, train_binds(*flag)), FlagClass::Implemented);
  EXPECT_EQ(parse("").model.moe.expert_rank_capacity_factor, 0.0);
  EXPECT_EQ(parse("--moe-expert-rank-capacity-factor 1.25").model.moe.expert_rank_capacity_factor,
            1.25);
  std::string e = error_of({"--moe-expert-rank-capacity-factor", "0.9"});
  EXPECT_NE(e.find("--moe-expert-rank-capacity-factor 0.9 is out of range: it must be >= 1"), std::string::npos) << e;
  e = error_of({"--moe-expert-rank-capacity-factor", "1.5", "--moe-expert-capacity-factor", "1",
                "--moe-pad-expert-input-to-capacity"});
  EXPECT_NE(e.find("with --moe-pad-expert-input-to-capacity: padded dispatch already has static "
                   "rows"),
            std::string::npos)
      << e;
}

// --fp32 spells out the default; with --bf16 a run would train bf16 silently. Refused, naming
// both flags and the fix, whichever comes first and wherever each is given (a --config file).
TEST(MegatronFlags, Fp32WithBf16IsRefused) {
  EXPECT_FALSE(parse("--fp32").model.bf16);
  EXPECT_TRUE(parse("--bf16").model.bf16);
  for (const std::vector<std::string>& given :
       {std::vector<std::string>{"--fp32", "--bf16"}, {"--bf16", "--fp32"}}) {
    const std::string e = error_of(given);
    EXPECT_NE(e.find("--fp32 and --bf16 are both given"), std::string::npos) << e;
    EXPECT_NE(e.find("remove one of them"), std::string::npos) << e;
  }
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path().empty());
  const std::string toml = scratch.path() + "/fp32.toml";
  std::ofstream(toml) << "fp32 = true\n";
  const std::string e = error_of({"--config", toml, "--bf16"});
  EXPECT_NE(e.find("--fp32 and --bf16 are both given"), std::string::npos) << e;
}

// A check between two flags names the flag(s) to change and to what: configs/tiny.toml warms up
// for 20 iterations, so a short run of it (--train-iters 5, whose value --lr-decay-iters takes)
// must say to lower --lr-warmup-iters, not only that 5 must exceed 20.
TEST(MegatronFlags, TwoFlagChecksNameTheFlagToChange) {
  std::string e = error_of({"--lr-warmup-iters", "20", "--train-iters", "5"});
  EXPECT_NE(e.find("--lr-decay-iters=5 (not given: --train-iters) must exceed "
                   "--lr-warmup-iters=20: give --lr-warmup-iters below 5 (0 for no warmup), or "
                   "--lr-decay-iters above 20"),
            std::string::npos)
      << e;
  e = error_of({"--lr-warmup-iters", "20", "--lr-decay-iters", "10"});
  EXPECT_NE(e.find("--lr-decay-iters=10 must exceed --lr-warmup-iters=20: give --lr-warmup-iters "
                   "below 10"),
            std::string::npos)
      << e;
  EXPECT_EQ(error_of({"--lr-warmup-iters", "20", "--lr-decay-style", "constant"}), "");
  EXPECT_EQ(error_of({"--lr-warmup-iters", "1"}), "");
  const std::string tiny = ::moecore::testing::source_dir() + "/configs/tiny.toml";
  e = error_of({"--config", tiny, "--train-iters", "5"});
  EXPECT_NE(e.find("give --lr-warmup-iters below 5"), std::string::npos) << e;
  e = error_of({"--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5"});
  EXPECT_NE(e.find("give --lr-wsd-decay-iters N with 0 < N <= 2"), std::string::npos) << e;
  e = error_of({"--min-lr", "0.1"});
  EXPECT_NE(e.find("lower --min-lr to at most 0.001 or raise --lr to at least 0.1"),
            std::string::npos)
      << e;
  e = error_of({"--max-position-embeddings", "8"});
  EXPECT_NE(e.find("raise --max-position-embeddings to 16 or lower --seq-length to 8"),
            std::string::npos)
      << e;
  e = error_of({"--moe-router-topk", "5"});
  EXPECT_NE(e.find("lower --moe-router-topk to at most 4 or raise --num-experts to at least 5"),
            std::string::npos)
      << e;
  e = error_of({"--moe-router-num-groups", "2", "--moe-router-group-topk", "3"});
  EXPECT_NE(e.find("lower --moe-router-group-topk to at most 2"), std::string::npos) << e;
  e = error_of({"--group-query-attention", "--num-query-groups", "3"});
  EXPECT_NE(e.find("give --num-query-groups a divisor of 2"), std::string::npos) << e;
}

TEST(MegatronFlags, DocsFlagsMdIsCurrent) {
  std::ifstream in(::moecore::testing::source_dir() + "/docs/flags.md");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  const std::string begin = "<!-- generated: moecore train --flags-markdown -->\n";
  const std::string end = "<!-- end generated -->";
  const size_t b = doc.find(begin), e = doc.find(end);
  ASSERT_NE(b, std::string::npos);
  ASSERT_NE(e, std::string::npos);
  EXPECT_EQ(doc.substr(b + begin.size(), e - b - begin.size()), train_flags_markdown())
      << "regenerate: build/moecore train --flags-markdown, between the markers of docs/flags.md";
}

// A save directory of this process's own for the recipes' checkpointing flags (the run checks it
// before step 0; no other run of the suite shares it).
std::string save_dir() {
  return (std::filesystem::temp_directory_path() /
          ("moecore_recipe_ckpt." + std::to_string(::getpid())))
      .string();
}

// A recipe's flags, sizes shrunk, two steps on the synthetic language.
void trains(const std::string& recipe, const std::string& shrunk) {
  TrainFlags f = parse_train_args(words(recipe + " " + shrunk));
  f.train.peak_gflops = 100;  // no GEMM probe
  train::Trainer trainer(f.model, f.train);
  for (int i = 0; i < 2; ++i) {
    const train::StepMetrics m = trainer.train_step();
    EXPECT_TRUE(std::isfinite(m.lm_loss)) << recipe;
  }
}

// Each refused flag of a recipe stops, naming what is missing and the issue that adds it.
void refused(const std::string& recipe, const std::string& shrunk,
             const std::vector<std::pair<std::string, std::string>>& flags) {
  for (const auto& [flag, issue] : flags) {
    SCOPED_TRACE(flag);
    try {
      parse_train_args(words(recipe + " " + shrunk + " " + flag));
      ADD_FAILURE() << "accepted " << flag;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("not implemented yet" + issue), std::string::npos) << msg;
    }
  }
}

std::string tokenizer_fixture(const std::string& name) {
  return ::moecore::testing::source_dir() + "/tests/fixtures/tokenizers/" + name;
}
// The recipes' --tokenizer-type HuggingFaceTokenizer with a small tokenizer.json, on mock data.
const std::string kHuggingFaceMock =
    " --mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model " +
    tokenizer_fixture("hf_llama3");

// A recipe's flags from tests/fixtures/recipes/ (tests/train/recipes_mpi.sh runs the same files
// under mpirun): its words, the lines starting with '#' left out; empty when it cannot be read
// (the tests that use it check).
std::string recipe_file(const std::string& name) {
  std::ifstream in(::moecore::testing::source_dir() + "/tests/fixtures/recipes/" + name);
  std::string out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    out += line + " ";
  }
  return out;
}

// Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (but the refused flags
// below), and its sizes shrunk with the synthetic language for the data flags.
const std::string kMixtral = recipe_file("mixtral_8x7b.flags");
const std::string kShrunk = recipe_file("mixtral_8x7b.shrunk");

TEST(MegatronRecipes, Mixtral8x7B) {
  ASSERT_FALSE(kMixtral.empty() || kShrunk.empty()) << "tests/fixtures/recipes/mixtral_8x7b.*";
  // The script's MODEL_PARALLEL_ARGS give --use-distributed-optimizer, which its
  // --overlap-param-gather needs (Megatron refuses it otherwise, and so does moecore).
  const std::string shrunk = kShrunk + " --use-distributed-optimizer";
  trains(kMixtral, shrunk);
  // The recipe's pipeline parallelism (PP 4) parses; the ranks check it against the world.
  EXPECT_EQ(parse_train_args(words(kMixtral + " " + shrunk + " --pipeline-model-parallel-size 4"))
                .parallel.pp,
            4);
  try {
    parse_train_args(words(kMixtral + " " + kShrunk));
    ADD_FAILURE() << "accepted --overlap-param-gather without --use-distributed-optimizer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--overlap-param-gather needs"), std::string::npos)
        << e.what();
  }
  // The recipe's CHECKPOINTING_ARGS (nothing is saved or loaded: trains() runs steps only).
  trains(kMixtral, shrunk + " --save " + save_dir() + " --load " + save_dir() +
                       " --save-interval 10000 --no-load-optim --no-load-rng");
  // The recipe's tokenizer (a Llama-2 SentencePiece model) on mock data.
  trains(kMixtral, shrunk + " --mock-data --tokenizer-type Llama2Tokenizer" +
                       " --tokenizer-model " + tokenizer_fixture("sp_bpe.model"));
}

// examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh (MODEL_ARGS; the script adds the
// training flags, lr and iterations, itself), shrunk; and Qwen3-235B-A22B.sh below.
const std::string kQwen3_30B = recipe_file("qwen3_30b_a3b.flags");
const std::string kQwenShrunk = recipe_file("qwen3_30b_a3b.shrunk");

TEST(MegatronRecipes, Qwen3_30B_A3B) {
  ASSERT_FALSE(kQwen3_30B.empty() || kQwenShrunk.empty())
      << "tests/fixtures/recipes/qwen3_30b_a3b.*";
  // Without --attention-dropout / --hidden-dropout, Megatron trains with dropout 0.1.
  trains(kQwen3_30B, kQwenShrunk);
  trains(kQwen3_30B, std::string(kQwenShrunk) + " --attention-dropout 0 --hidden-dropout 0");
  trains(kQwen3_30B, std::string(kQwenShrunk) + " --attention-dropout 0 --hidden-dropout 0" +
                         " --save " + save_dir() + " --save-interval 100000");
  trains(kQwen3_30B, std::string(kQwenShrunk) + " --attention-dropout 0 --hidden-dropout 0" +
                         kHuggingFaceMock);
}

const char* kQwen3_235B =
    "--micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear"
    " --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion"
    " --normalization RMSNorm --swiglu --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288"
    " --num-attention-heads 64 --group-query-attention --num-query-groups 4 --kv-channels 128"
    " --qk-layernorm --num-experts 128 --moe-ffn-hidden-size 1536 --moe-router-topk 8"
    " --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall"
    " --moe-router-load-balancing-type aux_loss --moe-layer-recompute --seq-length 4096"
    " --max-position-embeddings 40960 --make-vocab-size-divisible-by 1187 --use-mcore-models"
    " --rotary-percent 1.0 --rotary-base 1000000 --rotary-seq-len-interpolation-factor 1"
    " --no-bias-swiglu-fusion --attention-dropout 0.0 --hidden-dropout 0.0 --sequence-parallel";

TEST(MegatronRecipes, Qwen3_235B_A22B) {
  ASSERT_FALSE(kQwenShrunk.empty()) << "tests/fixtures/recipes/qwen3_30b_a3b.shrunk";
  trains(kQwen3_235B, kQwenShrunk);
  refused(kQwen3_235B, kQwenShrunk, {{"--rotary-seq-len-interpolation-factor 2", ""}});
  trains(kQwen3_235B, std::string(kQwenShrunk) + kHuggingFaceMock);
}

// examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh (DeepSeek-V3's architecture):
// its MoE and model flags, without multi-latent attention (its sizes and YaRN flags are
// accepted, inert without it, as in Megatron), then with it below.
const char* kDeepSeekV3 =
    "--micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear"
    " --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion"
    " --normalization RMSNorm --swiglu --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432"
    " --num-attention-heads 128 --kv-channels 128 --qk-layernorm --num-experts 256"
    " --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 --moe-router-dtype fp32"
    " --moe-router-score-function sigmoid --moe-router-bias-update-rate 1e-3"
    " --moe-router-enable-expert-bias --moe-router-topk 8 --moe-router-num-groups 8"
    " --moe-router-group-topk 4 --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5"
    " --moe-shared-expert-overlap --moe-shared-expert-intermediate-size 2048"
    " --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type seq_aux_loss"
    " --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --seq-length 4096"
    " --max-position-embeddings 163840 --make-vocab-size-divisible-by 1280 --use-mcore-models"
    " --rotary-base 10000 --rotary-percent 1.0 --mscale 1.0 --recompute-activations"
    " --moe-layer-recompute --sequence-parallel";
const char* kDeepSeekShrunk =
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4"
    " --kv-channels 8 --num-experts 16 --moe-layer-freq [0]*1+[1]*1 --moe-ffn-hidden-size 16"
    " --moe-shared-expert-intermediate-size 16 --seq-length 16 --max-position-embeddings 32"
    " --global-batch-size 2 --train-iters 2 --lr 1e-3 --vocab-size 64"
    " --attention-dropout 0 --hidden-dropout 0";

TEST(MegatronRecipes, DeepSeekV3) {
  trains(kDeepSeekV3, kDeepSeekShrunk);
  trains(kDeepSeekV3, std::string(kDeepSeekShrunk) +
                          " --kv-lora-rank 512 --q-lora-rank 1536 --rotary-scaling-factor 40"
                          " --mscale-all-dim 1.0");
  // With multi-latent attention, its sizes shrunk (the recipe's --recompute-activations and
  // --moe-layer-recompute with Megatron's mla_up_proj beside the core).
  trains(kDeepSeekV3, std::string(kDeepSeekShrunk) +
                          " --multi-latent-attention --kv-lora-rank 12 --q-lora-rank 16"
                          " --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 8"
                          " --rotary-scaling-factor 40 --mscale-all-dim 1.0"
                          " --recompute-modules core_attn mla_up_proj moe");
  trains(kDeepSeekV3, std::string(kDeepSeekShrunk) + kHuggingFaceMock);
}

// Qwen1.5-MoE-A2.7B's architecture (Qwen2-MoE) as Megatron flags: QKV bias, a gated shared
// expert of 4 x the expert width, 60 experts top-4; and Qwen3-MoE's attention_bias option, which
// adds the output projection's bias (moecore's --add-attention-output-bias).
const char* kQwen2Moe =
    "--micro-batch-size 1 --bf16 --disable-bias-linear --add-qkv-bias"
    " --untie-embeddings-and-output-weights --position-embedding-type rope --normalization RMSNorm"
    " --swiglu --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632"
    " --num-attention-heads 16 --num-experts 60 --moe-ffn-hidden-size 1408 --moe-router-topk 4"
    " --moe-shared-expert-intermediate-size 5632 --moe-shared-expert-gate"
    " --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3"
    " --moe-token-dispatcher-type alltoall --seq-length 4096 --max-position-embeddings 8192"
    " --rotary-base 1000000 --attention-dropout 0 --hidden-dropout 0 --use-mcore-models";
const char* kQwen2MoeShrunk =
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4"
    " --num-experts 8 --moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 32"
    " --seq-length 16 --max-position-embeddings 32 --global-batch-size 2 --train-iters 2"
    " --lr 1e-3 --vocab-size 64";

TEST(MegatronRecipes, Qwen2MoeSharedExpertGate) {
  trains(kQwen2Moe, kQwen2MoeShrunk);
  trains(kQwen2Moe, std::string(kQwen2MoeShrunk) + " --add-attention-output-bias");
}

}  // namespace
}  // namespace moecore::cli
