// DeepSeek-V3 (DeepseekV3ForCausalLM) on the HuggingFace side: config.json read into the spec
// moecore's flags are made of (multi-latent attention, YaRN RoPE, grouped sigmoid routing with
// expert bias, the MTP layers), refusing by key what moecore's model would compute differently,
// and written back; and the name contract of its tensors (docs/hf_interop.md, section 11):
// which HF tensor becomes which moecore tensor, FP8 weights dequantized on read. The tensor
// table both directions use is hf_tensor_map.h's, the flags model_flags.h's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert/fp8_block_dequant.h"

namespace moecore::convert {

struct DeepseekV3Spec {
  int64_t vocab_size = 0, hidden = 0, num_layers = 0, num_heads = 0;
  int64_t ffn_hidden = 0;      // intermediate_size: the dense layers
  int64_t moe_ffn_hidden = 0;  // moe_intermediate_size: each routed and shared expert
  int64_t num_experts = 0, topk = 0, num_shared_experts = 0;
  int64_t num_groups = 0, group_topk = 0;
  int64_t first_k_dense = 0;  // first_k_dense_replace: layers [0, k) dense, the rest MoE
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  std::optional<int64_t> q_lora_rank;  // null: q_proj straight from the hidden state
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  double rms_norm_eps = 1e-6, rope_theta = 1e4;
  double attention_dropout = 0;
  // YaRN (rope_parameters / rope_scaling of rope_type "yarn"); factor 0: no scaling. mscale and
  // mscale_all_dim are 0 when absent or null, as transformers reads them (falsy: not set).
  double rope_factor = 0, mscale = 0, mscale_all_dim = 0, beta_fast = 32, beta_slow = 1;
  int64_t original_max_position_embeddings = 0;
  // Whether q's and k's rotary elements pair as (2i, 2i + 1) (DeepSeek's own layout, moecore's)
  // or as (i, i + D/2) (false: the import permutes the rotary rows, export permutes them back).
  bool rope_interleave = true;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  int64_t mtp_layers = 0;  // num_nextn_predict_layers, stored as model.layers.{L + i}
  std::optional<Fp8BlockSize> fp8_block;  // quantization_config fp8: weight_block_size

  bool operator==(const DeepseekV3Spec&) const = default;
};

// True for model_type "deepseek_v3" and/or architectures ["DeepseekV3ForCausalLM"], when no
// key names another model.
bool is_deepseek_v3_config(const nlohmann::json& cfg);

// Reads config.json (`where` names it in messages); refuses, naming the key and its value, what
// moecore's model (Megatron's semantics) would compute differently from transformers'
// DeepseekV3ForCausalLM (docs/hf_interop.md, section 11): another RoPE type than default or
// yarn, a YaRN attention factor Megatron's mscale flags cannot give, attention_bias, a
// hidden_act other than silu, norm_topk_prob that Megatron's sigmoid router cannot follow, group
// limits Megatron scores differently, an odd qk_rope_head_dim, a quantization other than fp8
// e4m3 with a weight_block_size of two positive sizes.
DeepseekV3Spec parse_deepseek_v3_config(const nlohmann::json& cfg, const std::string& where);

// The config.json of `s` as transformers 5.x writes it (rope_parameters), with rope_theta and
// rope_scaling beside it for 4.x readers; quantization_config only when `s` has FP8 blocks.
// Reads back to `s` (parse_deepseek_v3_config).
nlohmann::json deepseek_v3_config_json(const DeepseekV3Spec& s, const std::string& torch_dtype);

// Where one HF tensor goes: the moecore tensor and which part of it.
struct DeepseekV3Target {
  std::string moecore;  // the moecore parameter name (the stacked experts: one for all E)
  // "" the whole tensor; "gate" / "up": the first / second half of the rows of a linear_fc1
  // ([gate; up]); "expert": expert `expert` of a stacked [E, ...] tensor (with "gate"/"up" in
  // `part2` for linear_fc1); "scale": the block scales of the FP8 weight `moecore` is made of
  // (consumed by dequantization, no tensor of its own); "copy": a copy of a main-model tensor
  // that the MTP layer stores again (checked equal, not imported twice).
  std::string part;
  int64_t expert = -1;
  std::string part2;
};

// The target of HF tensor `hf_name` of a DeepSeek-V3 checkpoint of `s`, or nullopt when the name
// is no tensor of such a checkpoint. A pure function: the contract the model side implements.
std::optional<DeepseekV3Target> deepseek_v3_tensor_target(std::string_view hf_name,
                                                          const DeepseekV3Spec& s);

}  // namespace moecore::convert
