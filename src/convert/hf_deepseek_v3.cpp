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
// config.json); default or yarn. transformers' YaRN (modeling_rope_utils.py:
// _compute_yarn_parameters; DeepseekV3Attention.__init__ for the softmax scale) against
// Megatron's (ops/rope_yarn.h), which moecore's model computes:
// - cos and sin times get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both
//   are set (non-zero), else times get_mscale(factor) (mscale 1, nothing divided). Megatron
//   always divides, with get_mscale(f, 0) = 1: the same when mscale_all_dim is 0 and mscale 1
//   (the flags then say so), or when both are set; mscale unset with mscale_all_dim set has no
//   Megatron spelling and is refused, as is an explicit attention_factor.
// - the softmax scale times get_mscale(factor, mscale_all_dim)^2: Megatron's too.
// - the ramp between original_max_position_embeddings' correction dims, floored and ceiled
//   (truncate, the default; Megatron always rounds): false is refused.
// - transformers versions differ in whether `factor` or max_position_embeddings /
//   original_max_position_embeddings is the factor; a config where they differ is refused.
void read_rope(const HfConfigReader& r, const json& cfg, DeepseekV3Spec& s) {
  const char* key = cfg.contains("rope_parameters") && !cfg["rope_parameters"].is_null()
                        ? "rope_parameters"
                        : "rope_scaling";
  if (r.has("rope_theta")) s.rope_theta = r.number("rope_theta", s.rope_theta);
  if (r.number("partial_rotary_factor", 1.0) != 1.0)
    r.refuse("partial_rotary_factor", r.text("partial_rotary_factor"),
             "MLA rotates the whole qk_rope_head_dim part of each head");
  if (!r.has(key)) return;
  MOE_CHECK(r.at(key).is_object(), "{}: \"{}\" is {}, not an object", r.label(), key, r.text(key));
  const HfConfigReader p(r.at(key), r.where() + " " + key);
  if (p.has("rope_theta")) s.rope_theta = p.number("rope_theta", s.rope_theta);
  if (p.number("partial_rotary_factor", 1.0) != 1.0)
    r.refuse(key, r.text(key), "MLA rotates the whole qk_rope_head_dim part of each head");
  const std::string type = p.string("rope_type", p.string("type", "default"));
  if (type == "default") return;
  if (type != "yarn")
    r.refuse(key, r.text(key), "moecore's DeepSeek-V3 reads the default RoPE or yarn");
  s.rope_factor = p.number("factor", 1.0);
  if (!(s.rope_factor > 0))
    r.refuse(key, r.text(key), "YaRN's factor must be positive (the context's extension)");
  if (p.has("attention_factor"))
    r.refuse(key, r.text(key),
             "an explicit attention_factor: Megatron's YaRN derives cos and sin's factor from "
             "mscale and mscale_all_dim (--mscale, --mscale-all-dim)");
  if (!p.boolean("truncate", true))
    r.refuse(key, r.text(key),
             "truncate false: Megatron's YaRN rounds the correction range to whole dimensions");
  s.mscale = p.number("mscale", 0.0);
  s.mscale_all_dim = p.number("mscale_all_dim", 0.0);
  if (s.mscale == 0 && s.mscale_all_dim != 0 && s.rope_factor > 1)
    r.refuse(key, r.text(key),
             "mscale unset with mscale_all_dim set: transformers then scales cos and sin by "
             "0.1 ln(factor) + 1 alone, which Megatron's --mscale / --mscale-all-dim cannot "
             "give (set mscale 1.0 for that)");
  // transformers: `get("beta_fast") or 32`, `get("beta_slow") or 1`.
  s.beta_fast = p.number("beta_fast", 0.0);
  s.beta_slow = p.number("beta_slow", 0.0);
  if (s.beta_fast == 0) s.beta_fast = 32;
  if (s.beta_slow == 0) s.beta_slow = 1;
  // Absent: transformers takes max_position_embeddings (0 here says so).
  s.original_max_position_embeddings = p.integer("original_max_position_embeddings", 0);
  if (p.has("original_max_position_embeddings") && s.original_max_position_embeddings < 1)
    r.refuse(key, r.text(key), "original_max_position_embeddings must be at least 1");
  if (p.has("original_max_position_embeddings") &&
      static_cast<double>(s.max_position_embeddings) /
              static_cast<double>(s.original_max_position_embeddings) !=
          s.rope_factor)
    r.refuse(
        key, r.text(key),
        fmt::format("factor {} is not max_position_embeddings / "
                    "original_max_position_embeddings = {} / {}: transformers versions "
                    "take one or the other as YaRN's factor",
                    s.rope_factor, s.max_position_embeddings, s.original_max_position_embeddings));
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
  s.attention_dropout = r.number("attention_dropout", 0.0);
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
  // Megatron's sigmoid router (MOE_SEMANTICS.md, Router 2) renormalises the K chosen scores
  // whenever K > 1 and never for K = 1; transformers' DeepseekV3MoE exactly when norm_topk_prob.
  if (s.norm_topk_prob != (s.topk > 1))
    r.refuse("norm_topk_prob", s.norm_topk_prob ? "true" : "false",
             fmt::format("with num_experts_per_tok {}, Megatron's sigmoid router (--moe-router-"
                         "score-function sigmoid) {} the chosen scores",
                         s.topk, s.topk > 1 ? "always renormalises" : "never renormalises"));
  // Group limits bind when some groups are left out: Megatron's group_limited_topk needs
  // topk_group to divide num_experts_per_tok, with at most a group's experts per group.
  if (s.group_topk < s.num_groups &&
      (s.topk % s.group_topk != 0 || s.topk / s.group_topk > s.num_experts / s.num_groups))
    r.refuse("topk_group", std::to_string(s.group_topk),
             fmt::format("Megatron's group-limited routing (--moe-router-group-topk) needs it to "
                         "divide num_experts_per_tok ({}) into at most n_routed_experts / n_group "
                         "({}) per group",
                         s.topk, s.num_experts / s.num_groups));
  // The group score: transformers' DeepseekV3MoE (and DeepSeek's own code) sums a group's two
  // best biased scores, Megatron's group_limited_topk (moecore's router) its top
  // num_experts_per_tok / topk_group. They agree when that is 2 (DeepSeek-V3: 8 / 4, V2: 6 / 3);
  // otherwise they keep other groups for some tokens, and the imported model would not compute
  // what transformers computes. The weights can still be taken under Megatron's routing: every
  // group kept in config.json, the group limits given to the trainer.
  if (s.group_topk < s.num_groups && s.topk / s.group_topk != 2)
    r.refuse("topk_group", std::to_string(s.group_topk),
             fmt::format("with num_experts_per_tok {}, moecore's group-limited routing "
                         "(Megatron's) scores a group by the sum of its top num_experts_per_tok / "
                         "topk_group = {} biased scores, transformers' DeepseekV3MoE by its top 2: "
                         "they keep other groups for some tokens (the same only when "
                         "num_experts_per_tok = 2 x topk_group, as DeepSeek-V3's 8 and 4). To "
                         "import the weights under Megatron's routing instead, set \"topk_group\" "
                         "to n_group ({}) and train with --moe-router-num-groups {} "
                         "--moe-router-group-topk {}",
                         s.topk, s.topk / s.group_topk, s.num_groups, s.num_groups, s.group_topk));
  if (s.first_k_dense < 0 || s.first_k_dense > s.num_layers)
    r.refuse("first_k_dense_replace", std::to_string(s.first_k_dense),
             fmt::format("must lie in [0, num_hidden_layers = {}]", s.num_layers));
  if (s.mtp_layers < 0 || s.mtp_layers > kMaxHfLayers)
    r.refuse("num_nextn_predict_layers", std::to_string(s.mtp_layers),
             fmt::format("must lie in [0, {}]", kMaxHfLayers));
  // The sizes that shape tensors: positive (a 0 or negative one would size nothing sensible),
  // and below 2^40, so that the tensors' sizes are products that fit int64 (the import refuses
  // what this machine cannot hold, in floating point, before sizing anything).
  constexpr int64_t kMaxSize = int64_t{1} << 40;
  if (s.num_shared_experts < 0 || s.num_shared_experts > (int64_t{1} << 20))
    r.refuse("n_shared_experts", std::to_string(s.num_shared_experts), "must lie in [0, 2^20]");
  for (const auto& [key, v] : {std::pair{"hidden_size", s.hidden},
                               {"vocab_size", s.vocab_size},
                               {"num_attention_heads", s.num_heads},
                               {"kv_lora_rank", s.kv_lora_rank},
                               {"qk_nope_head_dim", s.qk_nope_head_dim},
                               {"qk_rope_head_dim", s.qk_rope_head_dim},
                               {"v_head_dim", s.v_head_dim},
                               {"moe_intermediate_size", s.moe_ffn_hidden},
                               {"n_routed_experts", s.num_experts},
                               {"q_lora_rank", s.q_lora_rank.value_or(1)}}) {
    if (v < 1) r.refuse(key, std::to_string(v), "a size must be at least 1");
    if (v > kMaxSize) r.refuse(key, std::to_string(v), "a size must be below 2^40");
  }
  if (s.max_position_embeddings < 1 || s.max_position_embeddings > kMaxSize)
    r.refuse("max_position_embeddings", std::to_string(s.max_position_embeddings),
             "a size must lie in [1, 2^40]");
  if (s.first_k_dense > 0 && (s.ffn_hidden < 1 || s.ffn_hidden > kMaxSize))
    r.refuse("intermediate_size", std::to_string(s.ffn_hidden),
             "the dense layers (first_k_dense_replace) need a width in [1, 2^40]");
  if (s.qk_rope_head_dim % 2 != 0)
    r.refuse("qk_rope_head_dim", std::to_string(s.qk_rope_head_dim),
             "RoPE rotates pairs: the rotary part of a head must be even");
  return s;
}

json deepseek_v3_config_json(const DeepseekV3Spec& s, const std::string& torch_dtype) {
  json c;
  c["architectures"] = json::array({"DeepseekV3ForCausalLM"});
  c["model_type"] = "deepseek_v3";
  c["vocab_size"] = s.vocab_size;
  c["hidden_size"] = s.hidden;
  c["intermediate_size"] = s.ffn_hidden;
  c["moe_intermediate_size"] = s.moe_ffn_hidden;
  c["num_hidden_layers"] = s.num_layers;
  c["num_attention_heads"] = s.num_heads;
  c["num_key_value_heads"] = s.num_heads;
  c["n_shared_experts"] = s.num_shared_experts;
  c["n_routed_experts"] = s.num_experts;
  c["num_experts_per_tok"] = s.topk;
  c["routed_scaling_factor"] = s.routed_scaling_factor;
  c["n_group"] = s.num_groups;
  c["topk_group"] = s.group_topk;
  c["norm_topk_prob"] = s.norm_topk_prob;
  c["first_k_dense_replace"] = s.first_k_dense;
  c["q_lora_rank"] = s.q_lora_rank ? json(*s.q_lora_rank) : json(nullptr);
  c["kv_lora_rank"] = s.kv_lora_rank;
  c["qk_nope_head_dim"] = s.qk_nope_head_dim;
  c["qk_rope_head_dim"] = s.qk_rope_head_dim;
  c["v_head_dim"] = s.v_head_dim;
  // What DeepseekV3Config derives (5.x writes both): the q / k head and the rotary width.
  c["qk_head_dim"] = s.qk_nope_head_dim + s.qk_rope_head_dim;
  c["head_dim"] = s.qk_rope_head_dim;
  c["hidden_act"] = "silu";
  c["attention_bias"] = false;
  c["attention_dropout"] = s.attention_dropout;
  c["rms_norm_eps"] = s.rms_norm_eps;
  c["max_position_embeddings"] = s.max_position_embeddings;
  c["tie_word_embeddings"] = s.tie_word_embeddings;
  c["rope_interleave"] = s.rope_interleave;
  c["num_nextn_predict_layers"] = s.mtp_layers;
  json rope = {{"rope_type", "default"}, {"rope_theta", s.rope_theta}};
  if (s.rope_factor > 0) {
    rope["rope_type"] = "yarn";
    rope["factor"] = s.rope_factor;
    rope["mscale"] = s.mscale;
    rope["mscale_all_dim"] = s.mscale_all_dim;
    rope["beta_fast"] = s.beta_fast;
    rope["beta_slow"] = s.beta_slow;
    if (s.original_max_position_embeddings > 0)
      rope["original_max_position_embeddings"] = s.original_max_position_embeddings;
  }
  c["rope_parameters"] = rope;
  // 4.x reads these (DeepSeek's own config.json has them); 5.x reads rope_parameters first.
  c["rope_theta"] = s.rope_theta;
  json legacy = nullptr;
  if (s.rope_factor > 0) {
    legacy = rope;
    legacy.erase("rope_type");
    legacy.erase("rope_theta");
    legacy["type"] = "yarn";
  }
  c["rope_scaling"] = legacy;
  if (s.fp8_block) {
    c["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {s.fp8_block->rows, s.fp8_block->cols}}};
  }
  c["dtype"] = torch_dtype;        // 5.x
  c["torch_dtype"] = torch_dtype;  // 4.x
  return c;
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
