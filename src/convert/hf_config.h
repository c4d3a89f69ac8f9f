// HuggingFace config.json <-> the model it describes (docs/hf_interop.md, sections 3, 4, 7 and
// 11): MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, GPT2LMHeadModel and
// DeepseekV3ForCausalLM read into one HfModelSpec,
// refusing what moecore cannot represent with the key and its value, and the spec written back
// as the config.json that transformers reads. The spec is HF's view of the model; model_flags.h
// turns it into moecore's flags and back.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert/hf_config_reader.h"
#include "convert/hf_deepseek_v3.h"
#include "ops/activation.h"

namespace moecore::convert {

enum class HfArch : uint8_t { Mixtral, Qwen2Moe, Qwen3Moe, Gpt2, DeepseekV3 };

const char* hf_arch_class(HfArch a);  // "MixtralForCausalLM", ..., "DeepseekV3ForCausalLM"
const char* hf_model_type(HfArch a);  // "mixtral", "qwen2_moe", "qwen3_moe", "gpt2", "deepseek_v3"
// From a model_type ("qwen3_moe") or a class name ("Qwen3MoeForCausalLM"); nullopt otherwise.
std::optional<HfArch> parse_hf_arch(std::string_view name);

struct HfModelSpec {
  HfArch arch = HfArch::Mixtral;
  int64_t vocab_size = 0;    // V
  int64_t hidden = 0;        // H
  int64_t num_layers = 0;    // L
  int64_t num_heads = 0;     // Hq
  int64_t num_kv_heads = 0;  // Hkv
  int64_t head_dim = 0;      // D
  // intermediate_size: the dense layers' width (Qwen), the experts' width (Mixtral).
  int64_t ffn_hidden = 0;
  int64_t num_experts = 0;        // E
  int64_t topk = 0;               // K
  int64_t moe_ffn_hidden = 0;     // F (Mixtral: intermediate_size)
  int64_t shared_ffn_hidden = 0;  // S, Qwen2-MoE's gated shared expert (0: none)
  bool norm_topk_prob = true;     // the K weights renormalised (Mixtral: always)
  std::vector<int> moe_layers;    // one 0/1 per layer
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e4;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v biases (Qwen2-MoE's qkv_bias, Qwen3-MoE's attention_bias)
  bool attention_output_bias = false;  // the o_proj bias (Qwen3-MoE's attention_bias)
  bool qk_norm = false;                // q_norm / k_norm (Qwen3-MoE, always)
  // GPT-2: LayerNorm with a bias instead of RMSNorm (rms_norm_eps is then layer_norm_epsilon),
  // a learned [max_position_embeddings, H] position table instead of RoPE, an element-wise
  // activation instead of SwiGLU, and biases on every linear layer (qkv_bias and
  // attention_output_bias set too).
  bool layernorm = false;
  bool learned_positions = false;
  ops::Activation activation = ops::Activation::SwiGLU;
  bool mlp_bias = false;
  // GPT-2's attn_pdrop and resid_pdrop (training only; the other classes' must be 0).
  double attention_dropout = 0.0;
  double hidden_dropout = 0.0;
  // DeepSeek-V3: what its flags, tensors and config.json are made of (multi-latent attention,
  // YaRN, grouped sigmoid routing, MTP layers, FP8 blocks); the fields above hold the same sizes
  // as far as they mean the same (hf_spec_of_deepseek_v3), for what reads any spec.
  std::optional<DeepseekV3Spec> deepseek;

  bool operator==(const HfModelSpec&) const = default;
};

// The spec of DeepSeek-V3 model `d`: arch DeepseekV3, `deepseek` = d, and the shared fields
// (sizes, experts, MoE layers, norm epsilon, RoPE base, tying) from it.
HfModelSpec hf_spec_of_deepseek_v3(const DeepseekV3Spec& d);

// Reads config.json (`where` names it in messages). Throws for an architecture other than the
// five and for every setting moecore cannot represent, naming the key and its value
// (docs/hf_interop.md, section 7). Settings that only matter for training and that moecore
// does not convert (router_jitter_noise) add a line to *warnings.
HfModelSpec parse_hf_config(const nlohmann::json& cfg, const std::string& where,
                            std::vector<std::string>* warnings = nullptr);

// The config.json of `s` as transformers 5.x writes it, with the 4.x spellings beside where they
// differ (rope_theta, num_experts), `dtype` and `torch_dtype` = torch_dtype ("float32",
// "bfloat16"). Keys that do not describe the model (bos/eos/pad token ids, initializer_range,
// router_aux_loss_coef, use_cache, ...) are taken from `carry` (the imported config.json) when
// it has them, else HF's defaults.
nlohmann::json hf_config_json(const HfModelSpec& s, const std::string& torch_dtype,
                              const nlohmann::json* carry = nullptr);

}  // namespace moecore::convert
