// The architecture the planner models: everything `moecore train` trains plus what Megatron-Core
// and DeepSeek-V3 define beyond it (multi-token prediction), read
// from Megatron's flags (the same table and argparse layer as `moecore train`, but accepting the
// architecture flags the trainer refuses) or from a HuggingFace config.json.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "ops/activation.h"
#include "parallel/parallel_config.h"
#include "cli/megatron_argv.h"

namespace moecore::plan {

// DeepSeek-V3's MLA (Megatron's --multi-latent-attention and its ranks / head dims).
struct MlaSpec {
  int64_t q_lora_rank = 0;          // --q-lora-rank (0: None, a full-rank q projection)
  int64_t kv_lora_rank = 32;        // --kv-lora-rank
  int64_t qk_head_dim = 128;        // --qk-head-dim (the "nope" part)
  int64_t qk_pos_emb_head_dim = 64; // --qk-pos-emb-head-dim (the rope part)
  int64_t v_head_dim = 128;         // --v-head-dim
};

struct ModelSpec {
  std::string name;
  int64_t vocab_size = 0;       // padded (Megatron's --make-vocab-size-divisible-by x TP)
  int64_t vocab_unpadded = 0;
  int64_t hidden = 0;           // H
  int64_t num_layers = 0;       // L (decoder, without MTP)
  int64_t num_heads = 0;        // Hq
  int64_t num_query_groups = 0; // Hkv
  int64_t kv_channels = 0;      // D
  int64_t ffn_hidden = 0;       // dense MLP width
  // The MLPs' activation (fc1 is 2F wide when gated) and whether their fc1 / fc2 have biases
  // (Megatron's --add-bias-linear, its default; --disable-bias-linear turns them off).
  ops::Activation activation = ops::Activation::SwiGLU;
  bool add_mlp_bias = false;
  int64_t seq_length = 0;
  int64_t max_position_embeddings = 0;
  bool tie_embeddings = true;
  bool add_qkv_bias = false;
  bool add_attention_output_bias = false;  // linear_proj.bias (Megatron: --add-bias-linear)
  bool qk_layernorm = false;
  bool layernorm = false;          // LayerNorm (weight and bias) instead of RMSNorm
  bool learned_positions = false;  // a [max positions, H] table beside the word embedding
  int64_t num_experts = 0;      // E (0: dense)
  int64_t moe_ffn_hidden = 0;   // F per expert
  int64_t shared_ffn_hidden = 0;
  int64_t topk = 2;             // K
  std::vector<int> moe_layer_pattern;  // one 0/1 per layer
  std::optional<MlaSpec> mla;   // set with --multi-latent-attention
  int64_t mtp_num_layers = 0;   // --mtp-num-layers
  bool is_moe_layer(int64_t l) const {
    return num_experts > 0 && (moe_layer_pattern.empty() || moe_layer_pattern[l] != 0);
  }
  int64_t num_moe_layers() const;
};

// The run the plan is for: the layout and the batch.
struct RunSpec {
  // The layout, pipeline placement and schedule flags included (--num-virtual-stages-per-pipeline-
  // rank, --pipeline-model-parallel-layout, ...): pipeline_layout() reads them as the trainer does.
  parallel::ParallelConfig parallel;
  int64_t micro_batch = 1;
  int64_t global_batch = 0;           // 0: micro_batch x dp
  bool bf16 = false;
  bool fp32_residual_connection = false;  // with bf16: the residual stream kept f32
  bool distributed_optimizer = false; // --use-distributed-optimizer
  int64_t ddp_bucket_size = 0;        // --ddp-bucket-size (0: one bucket per backward stage)
  // Megatron's precision-aware optimizer (--main-params-dtype, --main-grads-dtype,
  // --exp-avg-dtype, --exp-avg-sq-dtype), bytes per element; and FP8 GEMMs (--fp8-format):
  // the linear layers' saved inputs are fp8. Modelled by formula only (the trainer has neither).
  double main_param_bytes = 4, main_grad_bytes = 4, exp_avg_bytes = 4, exp_avg_sq_bytes = 4;
  bool fp8 = false;
  RecomputeConfig recompute;          // --recompute-*
  std::vector<std::string> recompute_modules;  // as given (mla_up_proj included)
  // The token dispatch: --moe-token-dispatcher-type (Megatron's default allgather),
  // --moe-expert-capacity-factor (<= 0: dropless) and --moe-pad-expert-input-to-capacity.
  std::string dispatcher = "allgather";
  double capacity_factor = 0;
  bool pad_to_capacity = false;
};

// Virtual stages per pipeline rank of the run's placement (pipeline_layout: the
// --num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage or layout
// string flags); 1 without pipelining.
int virtual_stages(const ModelSpec& m, const RunSpec& run);

// The most decoder layers the planner plans (as `convert` reads, kMaxHfLayers): its planning
// pass builds every layer of a stage.
inline constexpr int64_t kMaxPlanLayers = int64_t{1} << 16;
// The most bytes a plan may count (1 EiB): past it no machine holds the model, and the int64
// byte counts of the trainer's planning pass would overflow.
inline constexpr int64_t kMaxPlanBytes = int64_t{1} << 60;

// The largest --gpus / --world-size planned: a search builds each layout's process groups, so
// its time grows with the world (8192 GPUs: seconds).
inline constexpr int64_t kMaxPlanGpus = parallel::kMaxWorldSize;

// Throws unless 1 <= n <= kMaxPlanLayers, naming `name` (the flag or config key).
void check_num_layers(int64_t n, const std::string& name);
// Every size of the model and the batch in range (>= 1, or >= 0 where 0 means none; top-k within
// the experts), and the bytes they imply under kMaxPlanBytes; the messages name the flag, or
// with from_hf the config.json key, and the value.
void check_model_spec(const ModelSpec& m, const RunSpec& run, bool from_hf);

// Reads the model and run flags from a parsed Megatron command line (megatron_argv.h), with
// Megatron's defaults and derivations (ffn width from hidden, query groups without GQA, vocab
// padding). Throws naming the flag when a required one is missing.
// model_from_args reads the model; run_from_args the layout, batch, precision and recompute
// (vocab_tp_pad: the model's vocabulary is re-padded for the run's TP, as Megatron pads it).
ModelSpec model_from_args(const cli::ParsedArgs& args);
RunSpec run_from_args(const cli::ParsedArgs& args);
// Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP.
void pad_vocab(ModelSpec& m, const cli::ParsedArgs& args, int tp);
// A HuggingFace config.json (DeepSeek-V3, Qwen3-MoE, Mixtral and Llama-like keys), read with
// the one reader of config.json keys (convert/hf_config_reader.h): `path` is read as a file,
// `cfg` already parsed (`where` names it). Defined in hf_model_spec.cpp.
ModelSpec spec_from_hf_config(const std::string& path);
ModelSpec spec_from_hf_config(const nlohmann::json& cfg, const std::string& where);

// The trainer's recomputation for the run: RunSpec::recompute, which leaves mla_up_proj out (a
// model without MLA refuses it), or for a model with multi-latent attention the modules as given.
RecomputeConfig trainer_recompute(const RunSpec& run, bool multi_latent_attention);
// The trainer's ModelConfig for this spec ; with `layers` set, only
// those decoder layers (a pipeline stage).
ModelConfig trainer_model_config(const ModelSpec& m, const RunSpec& run, int64_t first_layer = 0,
                                 int64_t num_layers = -1);

}  // namespace moecore::plan
