#include "cli/checkpoint_args.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <optional>

#include "ckpt/checkpoint_dir.h"
#include "core/check.h"
#include "cli/megatron_arguments.h"

namespace moecore::cli {
namespace {

// The flags that define the model and what it computes, by their first Megatron name (moecore's
// own by theirs). Megatron's load_args_from_checkpoint takes the network's size, attention,
// position embedding, normalization, bias and vocabulary flags and the MoE structure; the MoE
// routing flags join them here because moecore's router is part of the model's function.
constexpr const char* kModelFlags[] = {
    // Network size and attention.
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
    "--group-query-attention", "--num-query-groups", "--kv-channels", "--seq-length",
    "--max-position-embeddings", "--position-embedding-type", "--rotary-base",
    "--rotary-percent", "--normalization", "--norm-epsilon", "--swiglu", "--openai-gelu",
    "--squared-relu", "--apply-layernorm-1p", "--disable-bias-linear",
    "--add-qkv-bias", "--add-attention-output-bias", "--qk-layernorm",
    "--untie-embeddings-and-output-weights", "--init-method-std", "--attention-dropout",
    "--hidden-dropout",
    // Multi-latent attention.
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
    "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type", "--rotary-scaling-factor", "--mscale",
    "--mscale-all-dim", "--yarn-original-max-position-embeddings", "--yarn-beta-fast",
    "--yarn-beta-slow",
    // Multi-token prediction.
    "--mtp-num-layers", "--mtp-loss-scaling-factor",
    // Vocabulary and tokenizer.
    "--vocab-size", "--make-vocab-size-divisible-by", "--tokenizer-type", "--tokenizer-model",
    "--vocab-file", "--merge-file",
    // Mixture of experts: structure, routing, capacity, auxiliary losses.
    "--num-experts", "--moe-layer-freq", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--moe-router-topk",
    "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-pre-softmax",
    "--moe-router-topk-scaling-factor", "--moe-router-score-function", "--moe-router-dtype",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "--moe-router-quantile-balancing-ema", "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
    "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
    "--moe-token-drop-policy"};

}  // namespace

bool is_model_flag(const GivenFlag& g) {
  const std::string& name = g.megatron != nullptr ? g.megatron->name() : g.name;
  return std::find(std::begin(kModelFlags), std::end(kModelFlags), name) != std::end(kModelFlags);
}

std::vector<std::string> checkpoint_model_args(const std::string& load, int64_t ckpt_step,
                                               const std::vector<OwnFlag>& own) {
  MOE_CHECK(!load.empty(),
            "[checkpoint] --use-checkpoint-args takes the model's flags from the checkpoint "
            "being loaded: give --load DIR");
  std::optional<int64_t> it = ckpt_step >= 0 ? std::optional<int64_t>(ckpt_step)
                                             : ckpt::read_tracker(load);
  MOE_CHECK(it.has_value(),
            "[checkpoint] --use-checkpoint-args: '{}' holds no checkpoint (no {}) to take the "
            "model's flags from: give them on the command line",
            load, ckpt::kTrackerFile);
  const ckpt::CheckpointReader reader(ckpt::find_iteration_dir(load, *it),
                                      ckpt::HashCheck::None);
  const nlohmann::json& state = reader.manifest().state;
  MOE_CHECK(state.contains("args") && state["args"].is_array(),
            "[checkpoint] --use-checkpoint-args: '{}' records no flags (a checkpoint written "
            "before they were recorded): give the model's flags on the command line",
            reader.dir().string());
  std::vector<std::string> saved;
  for (const nlohmann::json& a : state["args"]) {
    MOE_CHECK(a.is_string(), "[checkpoint] '{}': the state's \"args\" holds {}, not a string",
              reader.dir().string(), a.dump());
    saved.push_back(a.get<std::string>());
  }
  return parse_megatron_argv(saved, own).args_for(is_model_flag);
}

}  // namespace moecore::cli
