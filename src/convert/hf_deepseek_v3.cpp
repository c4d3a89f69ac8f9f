#include "convert/hf_deepseek_v3.h"

#include <fmt/format.h>

#include <charconv>

#include "convert/hf_config_reader.h"
#include "core/check.h"

namespace moecore::convert {

using nlohmann::json;

bool is_deepseek_v3_config(const json& cfg) {
  if (!cfg.is_object()) return false;
  const auto t = cfg.find("model_type");
  const auto a = cfg.find("architectures");
  const bool has_t = t != cfg.end() && !t->is_null(), has_a = a != cfg.end() && !a->is_null();
  // Both given: both must name DeepSeek-V3 (a config whose two keys disagree is refused by
  // parse_hf_config, naming them).
  if (has_t && *t != "deepseek_v3") return false;
  if (has_a && !(a->is_array() && a->size() == 1 && (*a)[0] == "DeepseekV3ForCausalLM"))
    return false;
  return has_t || has_a;
}

namespace {

// RoPE: rope_parameters (transformers 5.x) or rope_theta + rope_scaling (4.x, DeepSeek's own
// config.json); default or yarn.
void read_rope(const HfConfigReader& r, const json& cfg, DeepseekV3Spec& s) {
  const char* key = cfg.contains("rope_parameters") && !cfg["rope_parameters"].is_null()
                        ? "rope_parameters"
                        : "rope_scaling";
  if (r.has("rope_theta")) s.rope_theta = r.number("rope_theta", s.rope_theta);
  if (!r.has(key)) return;
  const HfConfigReader p(r.at(key), r.where() + " " + key);
  if (p.has("rope_theta")) s.rope_theta = p.number("rope_theta", s.rope_theta);
  const std::string type = p.string("rope_type", p.string("type", "default"));
  if (type == "default") return;
  if (type != "yarn")
    r.refuse(key, r.text(key), "moecore's DeepSeek-V3 reads the default RoPE or yarn");
  s.rope_factor = p.number("factor", 1.0);
  s.mscale = p.number("mscale", 1.0);
  s.mscale_all_dim = p.number("mscale_all_dim", 0.0);
  s.beta_fast = p.number("beta_fast", 32.0);
  s.beta_slow = p.number("beta_slow", 1.0);
  s.original_max_position_embeddings = p.integer("original_max_position_embeddings");
}

void read_quantization(const HfConfigReader& r, DeepseekV3Spec& s) {
  if (!r.has("quantization_config")) return;
  const json& q = r.at("quantization_config");
  const HfConfigReader p(q, r.where() + " quantization_config");
  const bool fp8 = p.string("quant_method", "") == "fp8" && p.string("fmt", "e4m3") == "e4m3";
  const bool block = q.contains("weight_block_size") && q["weight_block_size"].is_array() &&
                     q["weight_block_size"].size() == 2 &&
                     q["weight_block_size"][0].is_number_integer() &&
                     q["weight_block_size"][1].is_number_integer() &&
                     q["weight_block_size"][0].get<int64_t>() >= 1 &&
                     q["weight_block_size"][1].get<int64_t>() >= 1;
  if (!fp8 || !block)
    r.refuse("quantization_config", q.dump(),
             "moecore dequantizes FP8 e4m3 weights with block scales only "
             "(quant_method \"fp8\", fmt \"e4m3\", weight_block_size [rows, cols])");
  s.fp8_block = Fp8BlockSize{q["weight_block_size"][0].get<int64_t>(),
                             q["weight_block_size"][1].get<int64_t>()};
}

}  // namespace

DeepseekV3Spec parse_deepseek_v3_config(const json& cfg, const std::string& where) {
  const HfConfigReader r(cfg, where);
  MOE_CHECK(is_deepseek_v3_config(cfg),
            "[convert] '{}' is not a DeepSeek-V3 config.json (model_type \"deepseek_v3\" or "
            "architectures [\"DeepseekV3ForCausalLM\"])",
            where);
  DeepseekV3Spec s;
  s.vocab_size = r.integer("vocab_size");
  s.hidden = r.integer("hidden_size");
  s.num_layers = r.num_layers("num_hidden_layers");
  s.num_heads = r.integer("num_attention_heads");
  const int64_t kv_heads = r.integer("num_key_value_heads", s.num_heads);
  if (kv_heads != s.num_heads)
    r.refuse("num_key_value_heads", r.text("num_key_value_heads"),
             "multi-latent attention has one KV head per query head (num_attention_heads)");
  s.ffn_hidden = r.integer("intermediate_size");
  s.moe_ffn_hidden = r.integer("moe_intermediate_size");
  s.num_experts = r.integer({"n_routed_experts"}, 0);
  s.topk = r.integer("num_experts_per_tok");
  s.num_shared_experts = r.integer("n_shared_experts", 0);
  s.num_groups = r.integer("n_group", 1);
  s.group_topk = r.integer("topk_group", 1);
  s.first_k_dense = r.integer("first_k_dense_replace", 0);
  s.norm_topk_prob = r.boolean("norm_topk_prob", true);
  s.routed_scaling_factor = r.number("routed_scaling_factor", 1.0);
  if (r.has("q_lora_rank")) s.q_lora_rank = r.integer("q_lora_rank");
  s.kv_lora_rank = r.integer("kv_lora_rank");
  s.qk_nope_head_dim = r.integer("qk_nope_head_dim");
  s.qk_rope_head_dim = r.integer("qk_rope_head_dim");
  s.v_head_dim = r.integer("v_head_dim");
  s.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  s.rope_interleave = r.boolean("rope_interleave", true);
  s.max_position_embeddings = r.integer("max_position_embeddings");
  s.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  s.mtp_layers = r.integer({"num_nextn_predict_layers", "num_mtp_layers"}, 0);
  read_rope(r, cfg, s);
  read_quantization(r, s);
  if (r.boolean("attention_bias", false))
    r.refuse("attention_bias", "true", "DeepSeek-V3's projections have no bias");
  if (r.string("hidden_act", "silu") != "silu")
    r.refuse("hidden_act", r.text("hidden_act"), "moecore's DeepSeek-V3 experts are SwiGLU");
  if (s.num_experts <= 0 || s.topk < 1 || s.topk > s.num_experts)
    r.refuse("num_experts_per_tok", std::to_string(s.topk),
             fmt::format("needs 1 <= num_experts_per_tok <= n_routed_experts ({})", s.num_experts));
  if (s.num_groups < 1 || s.num_experts % s.num_groups != 0 || s.group_topk < 1 ||
      s.group_topk > s.num_groups)
    r.refuse("n_group", std::to_string(s.num_groups),
             fmt::format("n_routed_experts ({}) must split into n_group groups and 1 <= "
                         "topk_group ({}) <= n_group",
                         s.num_experts, s.group_topk));
  if (s.first_k_dense < 0 || s.first_k_dense > s.num_layers)
    r.refuse("first_k_dense_replace", std::to_string(s.first_k_dense),
             fmt::format("must lie in [0, num_hidden_layers = {}]", s.num_layers));
  if (s.mtp_layers < 0 || s.mtp_layers > kMaxHfLayers)
    r.refuse("num_nextn_predict_layers", std::to_string(s.mtp_layers),
             fmt::format("must lie in [0, {}]", kMaxHfLayers));
  // The sizes that shape tensors: positive (a 0 or negative one would size nothing sensible).
  for (const auto& [key, v] : {std::pair{"hidden_size", s.hidden},
                               {"vocab_size", s.vocab_size},
                               {"num_attention_heads", s.num_heads},
                               {"kv_lora_rank", s.kv_lora_rank},
                               {"qk_nope_head_dim", s.qk_nope_head_dim},
                               {"qk_rope_head_dim", s.qk_rope_head_dim},
                               {"v_head_dim", s.v_head_dim},
                               {"moe_intermediate_size", s.moe_ffn_hidden},
                               {"q_lora_rank", s.q_lora_rank.value_or(1)}}) {
    if (v < 1) r.refuse(key, std::to_string(v), "a size must be at least 1");
  }
  return s;
}

std::vector<std::string> deepseek_v3_flags(const DeepseekV3Spec& s) {
  std::vector<std::string> f;
  auto add = [&](const char* name, const std::string& v = "") {
    f.emplace_back(name);
    if (!v.empty()) f.push_back(v);
  };
  auto num = [](double v) { return fmt::format("{}", v); };
  add("--num-layers", std::to_string(s.num_layers));
  add("--hidden-size", std::to_string(s.hidden));
  add("--ffn-hidden-size", std::to_string(s.ffn_hidden));
  add("--num-attention-heads", std::to_string(s.num_heads));
  add("--vocab-size", std::to_string(s.vocab_size));
  add("--max-position-embeddings", std::to_string(s.max_position_embeddings));
  add("--normalization", "RMSNorm");
  add("--norm-epsilon", num(s.rms_norm_eps));
  add("--swiglu");
  add("--disable-bias-linear");
  if (!s.tie_word_embeddings) add("--untie-embeddings-and-output-weights");
  add("--multi-latent-attention");
  // Megatron's MLA has q_layernorm (with q LoRA) and kv_layernorm only with --qk-layernorm, as
  // DeepSeek-V3's q_a_layernorm and kv_a_layernorm.
  add("--qk-layernorm");
  if (s.q_lora_rank) add("--q-lora-rank", std::to_string(*s.q_lora_rank));
  add("--kv-lora-rank", std::to_string(s.kv_lora_rank));
  add("--qk-head-dim", std::to_string(s.qk_nope_head_dim));
  add("--qk-pos-emb-head-dim", std::to_string(s.qk_rope_head_dim));
  add("--v-head-dim", std::to_string(s.v_head_dim));
  add("--position-embedding-type", "rope");
  add("--rotary-base", num(s.rope_theta));
  if (s.rope_factor > 0) {
    add("--rope-type", "yarn");
    add("--rotary-scaling-factor", num(s.rope_factor));
    add("--mscale", num(s.mscale));
    add("--mscale-all-dim", num(s.mscale_all_dim));
    add("--yarn-beta-fast", num(s.beta_fast));
    add("--yarn-beta-slow", num(s.beta_slow));
    add("--yarn-original-max-position-embeddings",
        std::to_string(s.original_max_position_embeddings));
  }
  add("--num-experts", std::to_string(s.num_experts));
  add("--moe-ffn-hidden-size", std::to_string(s.moe_ffn_hidden));
  add("--moe-router-topk", std::to_string(s.topk));
  add("--moe-router-score-function", "sigmoid");
  add("--moe-router-enable-expert-bias");
  if (s.num_groups > 1) {
    add("--moe-router-num-groups", std::to_string(s.num_groups));
    add("--moe-router-group-topk", std::to_string(s.group_topk));
  }
  add("--moe-router-topk-scaling-factor", num(s.routed_scaling_factor));
  if (s.num_shared_experts > 0)
    add("--moe-shared-expert-intermediate-size",
        std::to_string(s.num_shared_experts * s.moe_ffn_hidden));
  std::string pattern = "[";
  for (int64_t i = 0; i < s.num_layers; ++i)
    pattern += fmt::format("{}{}", i ? "," : "", i < s.first_k_dense ? 0 : 1);
  add("--moe-layer-freq", pattern + "]");
  if (s.mtp_layers > 0) add("--mtp-num-layers", std::to_string(s.mtp_layers));
  return f;
}

std::vector<std::string> deepseek_v3_missing_features(const DeepseekV3Spec& s) {
  std::vector<std::string> m = {"multi-latent attention (--multi-latent-attention)"};
  if (s.rope_factor > 0) m.emplace_back("YaRN RoPE (--rope-type yarn)");
  m.emplace_back("sigmoid routing with expert bias over groups (--moe-router-num-groups)");
  if (s.mtp_layers > 0) m.emplace_back("multi-token prediction (--mtp-num-layers)");
  return m;
}

namespace {

bool starts(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

// "12.rest" -> 12 and "rest"; nullopt when s does not start with digits and a dot.
std::optional<std::pair<int64_t, std::string_view>> index_then(std::string_view s) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end == s.data() || end == s.data() + s.size() || *end != '.' || v < 0)
    return std::nullopt;
  return std::make_pair(v, s.substr(static_cast<size_t>(end - s.data()) + 1));
}

// The target of a decoder layer's tensor `rest` (after "model.layers.{i}."), under `q` (the
// moecore layer prefix); MoE or dense as `moe` says.
std::optional<DeepseekV3Target> layer_target(std::string_view rest, const std::string& q, bool moe,
                                             const DeepseekV3Spec& s) {
  const std::string b = q + "self_attention.";
  static const std::pair<const char*, const char*> kDirect[] = {
      {"input_layernorm.weight", "input_layernorm.weight"},
      {"post_attention_layernorm.weight", "pre_mlp_layernorm.weight"},
      {"self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"},
      {"self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"},
      {"self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight"},
      {"self_attn.o_proj.weight", "self_attention.linear_proj.weight"},
  };
  for (const auto& [hf, mc] : kDirect)
    if (rest == hf) return DeepseekV3Target{q + mc, "", -1, ""};
  if (s.q_lora_rank) {
    if (rest == "self_attn.q_a_proj.weight")
      return DeepseekV3Target{b + "linear_q_down_proj.weight", "", -1, ""};
    if (rest == "self_attn.q_a_layernorm.weight")
      return DeepseekV3Target{b + "q_layernorm.weight", "", -1, ""};
    if (rest == "self_attn.q_b_proj.weight")
      return DeepseekV3Target{b + "linear_q_up_proj.weight", "", -1, ""};
  } else if (rest == "self_attn.q_proj.weight") {
    return DeepseekV3Target{b + "linear_q_proj.weight", "", -1, ""};
  }
  const std::string m = q + "mlp.";
  auto fc = [&](std::string_view x, const std::string& to) -> std::optional<DeepseekV3Target> {
    if (x == "gate_proj.weight") return DeepseekV3Target{to + "linear_fc1.weight", "gate", -1, ""};
    if (x == "up_proj.weight") return DeepseekV3Target{to + "linear_fc1.weight", "up", -1, ""};
    if (x == "down_proj.weight") return DeepseekV3Target{to + "linear_fc2.weight", "", -1, ""};
    return std::nullopt;
  };
  if (!starts(rest, "mlp.")) return std::nullopt;
  rest.remove_prefix(4);
  if (!moe) return fc(rest, m);
  if (rest == "gate.weight") return DeepseekV3Target{m + "router.weight", "", -1, ""};
  if (rest == "gate.e_score_correction_bias")
    return DeepseekV3Target{m + "router.expert_bias", "", -1, ""};
  if (starts(rest, "shared_experts.") && s.num_shared_experts > 0)
    return fc(rest.substr(15), m + "shared_experts.");
  if (starts(rest, "experts.")) {
    const auto e = index_then(rest.substr(8));
    if (!e || e->first >= s.num_experts) return std::nullopt;
    auto t = fc(e->second, m + "experts.");
    if (!t) return std::nullopt;
    return DeepseekV3Target{t->moecore, "expert", e->first, t->part};
  }
  return std::nullopt;
}

}  // namespace

std::optional<DeepseekV3Target> deepseek_v3_tensor_target(std::string_view hf_name,
                                                          const DeepseekV3Spec& s) {
  constexpr std::string_view kScale = "_scale_inv";
  if (hf_name.size() > kScale.size() && hf_name.ends_with(kScale)) {
    if (!s.fp8_block) return std::nullopt;
    auto t = deepseek_v3_tensor_target(hf_name.substr(0, hf_name.size() - kScale.size()), s);
    if (!t || t->part == "scale" || t->part == "copy") return std::nullopt;
    t->part2 = t->part == "expert" ? t->part2 : t->part;
    t->part = "scale";
    return t;
  }
  if (hf_name == "model.embed_tokens.weight")
    return DeepseekV3Target{"embedding.word_embeddings.weight", "", -1, ""};
  if (hf_name == "model.norm.weight")
    return DeepseekV3Target{"decoder.final_layernorm.weight", "", -1, ""};
  if (hf_name == "lm_head.weight" && !s.tie_word_embeddings)
    return DeepseekV3Target{"output_layer.weight", "", -1, ""};
  if (!starts(hf_name, "model.layers.")) return std::nullopt;
  const auto li = index_then(hf_name.substr(13));
  if (!li) return std::nullopt;
  const auto [i, rest] = *li;
  if (i < s.num_layers) {
    return layer_target(rest, fmt::format("decoder.layers.{}.", i), i >= s.first_k_dense, s);
  }
  if (i >= s.num_layers + s.mtp_layers) return std::nullopt;
  // The MTP layers, Megatron-Core's MultiTokenPredictionLayer: enorm / hnorm / eh_proj, a
  // transformer layer (MoE past first_k_dense_replace, as DeepSeek's), and the final norm of
  // its shared head; the embedding and the head are copies of the main model's.
  const std::string p = fmt::format("mtp.layers.{}.", i - s.num_layers);
  if (rest == "enorm.weight" || rest == "hnorm.weight" || rest == "eh_proj.weight")
    return DeepseekV3Target{p + std::string(rest), "", -1, ""};
  if (rest == "shared_head.norm.weight")
    return DeepseekV3Target{p + "final_layernorm.weight", "", -1, ""};
  if (rest == "embed_tokens.weight")
    return DeepseekV3Target{"embedding.word_embeddings.weight", "copy", -1, ""};
  if (rest == "shared_head.head.weight")
    return DeepseekV3Target{"output_layer.weight", "copy", -1, ""};
  return layer_target(rest, p + "transformer_layer.", i >= s.first_k_dense, s);
}

}  // namespace moecore::convert
