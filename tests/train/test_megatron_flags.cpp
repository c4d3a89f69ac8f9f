// Megatron-LM's command lines: every flag of the table parses as its class says, the
// implemented flags have Megatron's defaults, argparse's semantics, docs/flags.md is current,
// and the MoE launch flags of Megatron's own recipes run unchanged (sizes shrunk, synthetic data).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "train/megatron_argv.h"
#include "train/train_flags.h"
#include "train/trainer.h"

namespace moecore::train {
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
    " --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope"
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
  EXPECT_EQ(d.model.ffn_hidden, 0 * 32 + (4 * 32 * 2 / 3) / 64 * 64);  // SwiGLU's 2/3 of 4 h
  EXPECT_EQ(d.model.moe.dispatcher_type, DispatcherType::AllGather);
  // Required flags, as Megatron requires them.
  EXPECT_NE(error_of({"--lr"}).find("expected one argument"), std::string::npos);
  try {
    parse_train_args(words("--num-layers 2"));
    ADD_FAILURE() << "parsed without --hidden-size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--hidden-dropout"), std::string::npos) << e.what();
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
  const TrainFlags off = parse("--moe-shared-expert-intermediate-size 16");
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
  EXPECT_NE(e.find("--moe-expert-rank-capacity-factor 0.9 < 1"), std::string::npos) << e;
  e = error_of({"--moe-expert-rank-capacity-factor", "1.5", "--moe-expert-capacity-factor", "1",
                "--moe-pad-expert-input-to-capacity"});
  EXPECT_NE(e.find("with --moe-pad-expert-input-to-capacity: padded dispatch already has static "
                   "rows"),
            std::string::npos)
      << e;
}

TEST(MegatronFlags, DocsFlagsMdIsCurrent) {
  std::ifstream in(std::string(MOECORE_SOURCE_DIR) + "/docs/flags.md");
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

// A recipe's flags, sizes shrunk, two steps on the synthetic language.
void trains(const std::string& recipe, const std::string& shrunk) {
  TrainFlags f = parse_train_args(words(recipe + " " + shrunk));
  f.train.peak_gflops = 100;  // no GEMM probe
  Trainer trainer(f.model, f.train);
  for (int i = 0; i < 2; ++i) {
    const StepMetrics m = trainer.train_step();
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
  return std::string(MOECORE_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + name;
}
// The recipes' --tokenizer-type HuggingFaceTokenizer with a small tokenizer.json, on mock data.
const std::string kHuggingFaceMock =
    " --mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model " +
    tokenizer_fixture("hf_llama3");

// examples/mixtral/train_mixtral_8x7b_distributed.sh: MODEL_ARGS, MOE_ARGS, TRAINING_ARGS,
// MODEL_PARALLEL_ARGS and LOGGING_ARGS as they are, but the refused flags below.
const char* kMixtral =
    "--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768"
    " --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32"
    " --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm"
    " --position-embedding-type rope --swiglu --untie-embeddings-and-output-weights"
    " --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion"
    " --no-position-embedding --rotary-base 1000000"
    " --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss"
    " --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
    " --overlap-param-gather --overlap-grad-reduce"
    " --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000"
    " --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1"
    " --lr-warmup-iters 500 --clip-grad 1.0 --bf16"
    " --tensor-model-parallel-size 1 --expert-model-parallel-size 8 --sequence-parallel"
    " --log-interval 1 --tensorboard-dir /tmp/tensorboard --eval-interval 1000 --eval-iters 10";
// Sizes shrunk and the synthetic language for the data flags (--tokenizer-type,
// --tokenizer-model, --data-path, --split).
const char* kShrunk =
    "--seq-length 16 --max-position-embeddings 32 --num-layers 2 --hidden-size 32"
    " --ffn-hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --kv-channels 8"
    " --moe-ffn-hidden-size 16 --micro-batch-size 1 --global-batch-size 2 --train-iters 2"
    " --lr-decay-iters 2 --lr-warmup-iters 1 --expert-model-parallel-size 1 --vocab-size 64";

TEST(MegatronRecipes, Mixtral8x7B) {
  trains(kMixtral, kShrunk);
  refused(kMixtral, kShrunk,
          {{"--pipeline-model-parallel-size 4", ""}, {"--use-distributed-optimizer", ""}});
  // The recipe's CHECKPOINTING_ARGS (nothing is saved or loaded: trains() runs steps only).
  trains(kMixtral, std::string(kShrunk) + " --save /tmp/ckpt --load /tmp/ckpt" +
                       " --save-interval 10000 --no-load-optim --no-load-rng");
  // The recipe's tokenizer (a Llama-2 SentencePiece model) on mock data.
  trains(kMixtral, std::string(kShrunk) + " --mock-data --tokenizer-type Llama2Tokenizer" +
                       " --tokenizer-model " + tokenizer_fixture("sp_bpe.model"));
}

// examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh (MODEL_ARGS) and Qwen3-235B-A22B.sh.
const char* kQwen3_30B =
    "--micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear"
    " --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion"
    " --normalization RMSNorm --swiglu --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144"
    " --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128"
    " --qk-layernorm --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8"
    " --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall"
    " --moe-router-load-balancing-type aux_loss --seq-length 4096 --max-position-embeddings 40960"
    " --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0"
    " --rotary-base 1000000 --no-bias-swiglu-fusion --sequence-parallel";
// The recipe script adds the training flags (lr, iterations) itself.
const char* kQwenShrunk =
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4"
    " --num-query-groups 2 --kv-channels 8 --num-experts 8 --moe-ffn-hidden-size 16"
    " --seq-length 16 --max-position-embeddings 32 --global-batch-size 2 --train-iters 2"
    " --lr 1e-3 --vocab-size 64";

TEST(MegatronRecipes, Qwen3_30B_A3B) {
  // Without --attention-dropout / --hidden-dropout, Megatron trains with dropout 0.1.
  refused(kQwen3_30B, kQwenShrunk, {{"", ""}});
  trains(kQwen3_30B, std::string(kQwenShrunk) + " --attention-dropout 0 --hidden-dropout 0");
  trains(kQwen3_30B, std::string(kQwenShrunk) + " --attention-dropout 0 --hidden-dropout 0" +
                         " --save /tmp/ckpt --save-interval 100000");
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
  trains(kQwen3_235B, kQwenShrunk);
  refused(kQwen3_235B, kQwenShrunk, {{"--rotary-seq-len-interpolation-factor 2", ""}});
  trains(kQwen3_235B, std::string(kQwenShrunk) + kHuggingFaceMock);
}

// examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh (DeepSeek-V3's architecture):
// its MoE and model flags, without multi-latent attention (refused below; its --v-head-dim 128,
// --qk-head-dim 128 and --qk-pos-emb-head-dim 64 are Megatron's defaults, so they pass).
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
  refused(kDeepSeekV3, kDeepSeekShrunk,
          {{"--multi-latent-attention", ""},
           {"--kv-lora-rank 512", ""},
           {"--q-lora-rank 1536", ""},
           {"--rotary-scaling-factor 40", ""},
           {"--mscale-all-dim 1.0", ""}});
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
}  // namespace moecore::train
