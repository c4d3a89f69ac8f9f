#include "convert/hf_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "convert/hf_config_reader.h"
#include "core/check.h"

namespace moecore::convert {
namespace {

using nlohmann::json;

// HF's architecture: model_type and architectures[0] name the same class when both are given.
HfArch read_arch(const HfConfigReader& r, const std::string& where) {
  std::optional<HfArch> by_type, by_class;
  if (r.has("model_type")) {
    const std::string t = r.at("model_type").is_string() ? r.at("model_type").get<std::string>()
                                                         : r.text("model_type");
    by_type = parse_hf_arch(t);
    if (!by_type)
      r.refuse("model_type", r.text("model_type"),
               "moecore converts mixtral, qwen2_moe, qwen3_moe, gpt2 and deepseek_v3");
  }
  if (r.has("architectures")) {
    const json& a = r.at("architectures");
    MOE_CHECK(a.is_array() && a.size() == 1 && a[0].is_string(),
              "[convert] '{}': \"architectures\" is {}, not a list of one class name", where,
              a.dump());
    by_class = parse_hf_arch(a[0].get<std::string>());
    // The class itself, not its model_type ("gpt2" is no class name).
    if (!by_class || a[0].get<std::string>() != hf_arch_class(*by_class))
      r.refuse("architectures", a.dump(),
               "moecore converts MixtralForCausalLM, Qwen2MoeForCausalLM, "
               "Qwen3MoeForCausalLM, GPT2LMHeadModel and DeepseekV3ForCausalLM");
  }
  MOE_CHECK(by_type || by_class,
            "[convert] '{}' has neither \"model_type\" nor "
            "\"architectures\": which model it is cannot be told",
            where);
  MOE_CHECK(!by_type || !by_class || *by_type == *by_class,
            "[convert] '{}': \"model_type\" {} and \"architectures\" {} name different models",
            where, r.text("model_type"), r.text("architectures"));
  return by_type ? *by_type : *by_class;
}

// RoPE: rope_parameters (5.x) or rope_theta / rope_scaling (4.x); only the default RoPE over the
// whole head.
double read_rope_theta(const HfConfigReader& r, HfArch arch, const std::string& where) {
  // The classes' defaults when the config names no theta (MixtralConfig.default_theta,
  // RotaryEmbeddingConfigMixin.default_theta).
  double theta = arch == HfArch::Mixtral ? 1e6 : 1e4;
  if (r.has("rope_theta")) theta = r.number("rope_theta", theta);
  if (r.has("rope_scaling"))
    r.refuse("rope_scaling", r.text("rope_scaling"),
             "moecore implements the default RoPE only (no --use-rope-scaling)");
  if (r.has("partial_rotary_factor") && r.number("partial_rotary_factor", 1.0) != 1.0)
    r.refuse("partial_rotary_factor", r.text("partial_rotary_factor"),
             "moecore rotates the whole head (no --rotary-percent)");
  if (r.has("rope_parameters")) {
    const json& p = r.at("rope_parameters");
    MOE_CHECK(p.is_object(), "[convert] '{}': \"rope_parameters\" is {}, not an object", where,
              p.dump());
    if (p.contains("rope_type") && p["rope_type"] != "default")
      r.refuse("rope_parameters.rope_type", p["rope_type"].dump(),
               "moecore implements the default RoPE only (no --use-rope-scaling)");
    if (p.contains("partial_rotary_factor") && !p["partial_rotary_factor"].is_null() &&
        p["partial_rotary_factor"] != 1.0 && p["partial_rotary_factor"] != 1)
      r.refuse("rope_parameters.partial_rotary_factor", p["partial_rotary_factor"].dump(),
               "moecore rotates the whole head (no --rotary-percent)");
    if (p.contains("rope_theta") && !p["rope_theta"].is_null()) {
      MOE_CHECK(p["rope_theta"].is_number(),
                "[convert] '{}': \"rope_parameters.rope_theta\" is "
                "{}, not a number",
                where, p["rope_theta"].dump());
      theta = p["rope_theta"].get<double>();
    }
  }
  MOE_CHECK(theta > 0, "[convert] '{}': rope theta {} must be > 0", where, theta);
  return theta;
}

// transformers' ACT2FN names of the activations moecore computes: gelu_new (NewGELUActivation)
// and gelu_pytorch_tanh (GELUTanh, torch's gelu(approximate="tanh")) are the same tanh form of
// GeLU, written two ways (they round differently in the last bits); gelu is the exact erf form.
std::optional<ops::Activation> gpt2_activation(const std::string& name) {
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return ops::Activation::GeLUTanh;
  if (name == "gelu") return ops::Activation::GeLU;
  return std::nullopt;
}

// GPT2LMHeadModel (modeling_gpt2.py, configuration_gpt2.py): pre-norm blocks of LayerNorm,
// attention with biased c_attn / c_proj, an MLP c_fc -> activation -> c_proj with biases; a
// learned position table; every head of width n_embd / n_head, no GQA, no RoPE.
HfModelSpec parse_gpt2(const HfConfigReader& r, const std::string& where,
                       std::vector<std::string>* warnings) {
  HfModelSpec s;
  s.arch = HfArch::Gpt2;
  s.layernorm = true;
  s.learned_positions = true;
  s.mlp_bias = s.qkv_bias = s.attention_output_bias = true;
  const std::string act =
      r.has("activation_function") && r.at("activation_function").is_string()
          ? r.at("activation_function").get<std::string>()
          : (r.has("activation_function") ? r.text("activation_function") : "gelu_new");
  // GPT2MLP: ACT2FN[activation_function].
  if (const std::optional<ops::Activation> a = gpt2_activation(act)) {
    s.activation = *a;
  } else {
    r.refuse("activation_function", r.text("activation_function"),
             "moecore converts GPT-2's gelu_new and gelu_pytorch_tanh (the tanh form, "
             "--openai-gelu) and gelu (exact GeLU) only");
  }
  // GPT2Attention: these change the attention function itself.
  if (r.boolean("scale_attn_by_inverse_layer_idx", false))
    r.refuse(
        "scale_attn_by_inverse_layer_idx", "true",
        "moecore scales attention scores by 1/sqrt(head dim) alone, not also by 1/(layer + 1)");
  if (r.boolean("reorder_and_upcast_attn", false))
    r.refuse("reorder_and_upcast_attn", "true",
             "moecore computes the attention scores in the model's precision as transformers does "
             "without it; convert a model trained with it after setting it false, knowing the "
             "scores round differently");
  if (!r.boolean("scale_attn_weights", true))
    r.refuse("scale_attn_weights", "false", "moecore always scales by 1/sqrt(head dim)");
  if (r.boolean("add_cross_attention", false))
    r.refuse("add_cross_attention", "true", "moecore's GPT has no cross-attention");

  s.vocab_size = r.integer("vocab_size");
  s.hidden = r.integer("n_embd");
  s.num_layers = r.num_layers("n_layer");
  s.moe_layers.assign(static_cast<size_t>(s.num_layers), 0);  // GPT-2 has no MoE layer
  s.num_heads = r.integer("n_head");
  s.max_position_embeddings = r.integer("n_positions");
  // GPT2Block.__init__: inner_dim = n_inner if not None else 4 * hidden_size.
  s.ffn_hidden = r.integer("n_inner", 4 * s.hidden);
  MOE_CHECK(s.vocab_size >= 2 && s.hidden >= 1 && s.num_layers >= 1 && s.num_heads >= 1 &&
                s.max_position_embeddings >= 1 && s.ffn_hidden >= 1,
            "[convert] '{}': sizes must be positive (vocab_size {}, n_embd {}, n_layer {}, n_head "
            "{}, n_positions {}, n_inner {})",
            where, s.vocab_size, s.hidden, s.num_layers, s.num_heads, s.max_position_embeddings,
            s.ffn_hidden);
  if (s.hidden % s.num_heads != 0)
    r.refuse("n_head", std::to_string(s.num_heads),
             fmt::format("it must divide n_embd {} (GPT2Attention: head_dim = n_embd / n_head)",
                         s.hidden));
  s.num_kv_heads = s.num_heads;
  s.head_dim = s.hidden / s.num_heads;
  s.rms_norm_eps = r.number("layer_norm_epsilon", 1e-5);
  s.tie_word_embeddings = r.boolean("tie_word_embeddings", true);  // GPT2Config's default
  // Dropout: attention probabilities (attn_pdrop) and Megatron's hidden dropout, which also
  // drops the embeddings' sum (resid_pdrop; embd_pdrop has no flag of its own).
  s.attention_dropout = r.number("attn_pdrop", 0.1);
  s.hidden_dropout = r.number("resid_pdrop", 0.1);
  const double embd = r.number("embd_pdrop", 0.1);
  MOE_CHECK(s.attention_dropout >= 0 && s.attention_dropout < 1 && s.hidden_dropout >= 0 &&
                s.hidden_dropout < 1,
            "[convert] '{}': attn_pdrop {} and resid_pdrop {} must be in [0, 1)", where,
            s.attention_dropout, s.hidden_dropout);
  if (embd != s.hidden_dropout && warnings != nullptr)
    warnings->push_back(fmt::format(
        "[convert] '{}': \"embd_pdrop\": {} is not converted (training only): Megatron drops the "
        "embeddings with --hidden-dropout, resid_pdrop {}",
        where, embd, s.hidden_dropout));
  return s;
}

// GPT2Config's keys (configuration_gpt2.py) for `s`.
json gpt2_config_json(const HfModelSpec& s, const std::string& torch_dtype) {
  json c;
  c["architectures"] = json::array({hf_arch_class(s.arch)});
  c["model_type"] = hf_model_type(s.arch);
  c["vocab_size"] = s.vocab_size;
  c["n_embd"] = s.hidden;
  c["n_layer"] = s.num_layers;
  c["n_head"] = s.num_heads;
  c["n_inner"] = s.ffn_hidden;
  c["n_positions"] = s.max_position_embeddings;
  c["activation_function"] = s.activation == ops::Activation::GeLU ? "gelu" : "gelu_new";
  c["layer_norm_epsilon"] = s.rms_norm_eps;
  c["attn_pdrop"] = s.attention_dropout;
  c["resid_pdrop"] = s.hidden_dropout;
  c["embd_pdrop"] = s.hidden_dropout;
  c["scale_attn_weights"] = true;
  c["scale_attn_by_inverse_layer_idx"] = false;
  c["reorder_and_upcast_attn"] = false;
  c["add_cross_attention"] = false;
  c["tie_word_embeddings"] = s.tie_word_embeddings;
  c["dtype"] = torch_dtype;        // 5.x
  c["torch_dtype"] = torch_dtype;  // 4.x
  return c;
}

}  // namespace

const char* hf_arch_class(HfArch a) {
  switch (a) {
    case HfArch::Mixtral:
      return "MixtralForCausalLM";
    case HfArch::Qwen2Moe:
      return "Qwen2MoeForCausalLM";
    case HfArch::Qwen3Moe:
      return "Qwen3MoeForCausalLM";
    case HfArch::Gpt2:
      return "GPT2LMHeadModel";
    case HfArch::DeepseekV3:
      return "DeepseekV3ForCausalLM";
  }
  return "?";
}

const char* hf_model_type(HfArch a) {
  switch (a) {
    case HfArch::Mixtral:
      return "mixtral";
    case HfArch::Qwen2Moe:
      return "qwen2_moe";
    case HfArch::Qwen3Moe:
      return "qwen3_moe";
    case HfArch::Gpt2:
      return "gpt2";
    case HfArch::DeepseekV3:
      return "deepseek_v3";
  }
  return "?";
}

std::optional<HfArch> parse_hf_arch(std::string_view name) {
  for (HfArch a :
       {HfArch::Mixtral, HfArch::Qwen2Moe, HfArch::Qwen3Moe, HfArch::Gpt2, HfArch::DeepseekV3}) {
    if (name == hf_model_type(a) || name == hf_arch_class(a)) return a;
  }
  return std::nullopt;
}

HfModelSpec hf_spec_of_deepseek_v3(const DeepseekV3Spec& d) {
  HfModelSpec s;
  s.arch = HfArch::DeepseekV3;
  s.vocab_size = d.vocab_size;
  s.hidden = d.hidden;
  s.num_layers = d.num_layers;
  s.num_heads = d.num_heads;
  s.num_kv_heads = d.num_heads;  // MLA: a key and value per query head
  s.head_dim = d.qk_nope_head_dim + d.qk_rope_head_dim;
  s.ffn_hidden = d.ffn_hidden;
  s.num_experts = d.num_experts;
  s.topk = d.topk;
  s.moe_ffn_hidden = d.moe_ffn_hidden;
  s.shared_ffn_hidden = d.num_shared_experts * d.moe_ffn_hidden;
  s.norm_topk_prob = d.norm_topk_prob;
  for (int64_t i = 0; i < d.num_layers; ++i) s.moe_layers.push_back(i >= d.first_k_dense ? 1 : 0);
  s.rms_norm_eps = d.rms_norm_eps;
  s.rope_theta = d.rope_theta;
  s.max_position_embeddings = d.max_position_embeddings;
  s.tie_word_embeddings = d.tie_word_embeddings;
  s.attention_dropout = d.attention_dropout;
  s.deepseek = d;
  return s;
}

HfModelSpec parse_hf_config(const json& cfg, const std::string& where,
                            std::vector<std::string>* warnings) {
  const HfConfigReader r(cfg, where);
  if (is_deepseek_v3_config(cfg))
    return hf_spec_of_deepseek_v3(parse_deepseek_v3_config(cfg, where));
  HfModelSpec s;
  s.arch = read_arch(r, where);
  // is_deepseek_v3_config said no: its model_type is spelled as the class.
  if (s.arch == HfArch::DeepseekV3)
    r.refuse("model_type", r.text("model_type"), "DeepSeek-V3's model_type is \"deepseek_v3\"");
  if (s.arch == HfArch::Gpt2) return parse_gpt2(r, where, warnings);
  const bool mixtral = s.arch == HfArch::Mixtral;

  if (r.has("hidden_act") && r.at("hidden_act") != "silu")
    r.refuse("hidden_act", r.text("hidden_act"), "moecore's MLPs are SwiGLU (silu) only");
  if (r.number("attention_dropout", 0.0) != 0.0)
    r.refuse("attention_dropout", r.text("attention_dropout"),
             "moecore has no attention dropout; set it to 0.0");

  // Sliding windows: Mixtral's sliding_window; the Qwen models' use_sliding_window and
  // layer_types (5.x writes sliding_window: 0 when the window is off, so that key says nothing).
  if (mixtral && r.has("sliding_window"))
    r.refuse("sliding_window", r.text("sliding_window"),
             "moecore has no sliding-window attention; only null (full causal attention) is");
  if (!mixtral && r.boolean("use_sliding_window", false))
    r.refuse("use_sliding_window", "true", "moecore has no sliding-window attention");
  if (r.has("layer_types")) {
    MOE_CHECK(r.at("layer_types").is_array(), "[convert] '{}': \"layer_types\" is {}, not a list",
              where, r.text("layer_types"));
    for (const json& t : r.at("layer_types")) {
      if (t != "full_attention")
        r.refuse("layer_types", t.dump(),
                 "moecore has no sliding-window attention; every layer must be "
                 "\"full_attention\"");
    }
  }
  s.rope_theta = read_rope_theta(r, s.arch, where);

  s.vocab_size = r.integer("vocab_size");
  s.hidden = r.integer("hidden_size");
  // The layer count sizes vectors here and a model in the importer (HfConfigReader::num_layers).
  s.num_layers = r.num_layers("num_hidden_layers");
  s.num_heads = r.integer("num_attention_heads");
  s.max_position_embeddings = r.integer("max_position_embeddings");
  s.ffn_hidden = r.integer("intermediate_size");
  MOE_CHECK(s.vocab_size >= 2 && s.hidden >= 1 && s.num_layers >= 1 && s.num_heads >= 1 &&
                s.max_position_embeddings >= 1 && s.ffn_hidden >= 1,
            "[convert] '{}': sizes must be positive (vocab_size {}, hidden_size {}, "
            "num_hidden_layers {}, num_attention_heads {}, max_position_embeddings {}, "
            "intermediate_size {})",
            where, s.vocab_size, s.hidden, s.num_layers, s.num_heads, s.max_position_embeddings,
            s.ffn_hidden);
  s.num_kv_heads = r.integer("num_key_value_heads", s.num_heads);
  if (s.num_kv_heads < 1 || s.num_heads % s.num_kv_heads != 0)
    r.refuse("num_key_value_heads", std::to_string(s.num_kv_heads),
             fmt::format("it must divide num_attention_heads {} (grouped-query attention)",
                         s.num_heads));
  if (r.has("head_dim")) {
    s.head_dim = r.integer("head_dim", 0);
  } else {
    MOE_CHECK(s.hidden % s.num_heads == 0,
              "[convert] '{}': no \"head_dim\", and num_attention_heads {} does not divide "
              "hidden_size {}",
              where, s.num_heads, s.hidden);
    s.head_dim = s.hidden / s.num_heads;
  }
  if (s.head_dim < 2 || s.head_dim % 2 != 0)
    r.refuse("head_dim", std::to_string(s.head_dim),
             "RoPE rotates pairs: the head dim must be even");
  s.rms_norm_eps = r.number("rms_norm_eps", mixtral ? 1e-5 : 1e-6);
  s.tie_word_embeddings = r.boolean("tie_word_embeddings", false);

  // Experts and routing.
  if (mixtral) {
    s.num_experts = r.integer("num_local_experts");
    s.moe_ffn_hidden = s.ffn_hidden;
    s.norm_topk_prob = true;  // MixtralTopKRouter always renormalises
    s.moe_layers.assign(s.num_layers, 1);
    if (r.number("router_jitter_noise", 0.0) != 0.0 && warnings != nullptr) {
      warnings->push_back(fmt::format(
          "[convert] '{}': \"router_jitter_noise\": {} is not converted (training only; "
          "Megatron's --moe-input-jitter-eps jitters the router's input alone, HF the experts' "
          "too)",
          where, r.text("router_jitter_noise")));
    }
  } else {
    const bool n1 = r.has("num_experts"), n2 = r.has("num_local_experts");
    MOE_CHECK(n1 || n2, "[convert] '{}' has neither \"num_experts\" nor \"num_local_experts\"",
              where);
    s.num_experts = n1 ? r.integer("num_experts") : r.integer("num_local_experts");
    MOE_CHECK(!n1 || !n2 || r.integer("num_experts") == r.integer("num_local_experts"),
              "[convert] '{}': \"num_experts\" {} and \"num_local_experts\" {} differ", where,
              r.text("num_experts"), r.text("num_local_experts"));
    s.moe_ffn_hidden = s.num_experts > 0 ? r.integer("moe_intermediate_size") : 0;
    s.norm_topk_prob = r.boolean("norm_topk_prob", false);
    const int64_t step = r.integer("decoder_sparse_step", 1);
    if (step < 1) r.refuse("decoder_sparse_step", std::to_string(step), "it must be >= 1");
    std::vector<bool> listed(static_cast<size_t>(s.num_layers));
    if (r.has("mlp_only_layers")) {
      MOE_CHECK(r.at("mlp_only_layers").is_array(),
                "[convert] '{}': \"mlp_only_layers\" is {}, not a list", where,
                r.text("mlp_only_layers"));
      for (const json& v : r.at("mlp_only_layers")) {
        MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < s.num_layers,
                  "[convert] '{}': \"mlp_only_layers\" holds {}, not a layer of 0..{}", where,
                  v.dump(), s.num_layers - 1);
        listed[v.get<int64_t>()] = true;
      }
    }
    // Qwen2MoeDecoderLayer.__init__ (Qwen3's the same): sparse iff not listed, experts exist and
    // (i + 1) % decoder_sparse_step == 0. Megatron's integer --moe-layer-freq N means i % N == 0,
    // hence the explicit list.
    for (int64_t i = 0; i < s.num_layers; ++i) {
      s.moe_layers.push_back(!listed[i] && s.num_experts > 0 && (i + 1) % step == 0 ? 1 : 0);
    }
  }
  if (s.num_experts > 0) {
    s.topk = r.integer("num_experts_per_tok");
    if (s.topk < 1 || s.topk > s.num_experts)
      r.refuse("num_experts_per_tok", std::to_string(s.topk),
               fmt::format("it must be in 1..{} (the experts)", s.num_experts));
    MOE_CHECK(s.moe_ffn_hidden >= 1, "[convert] '{}': the experts' width {} must be >= 1", where,
              s.moe_ffn_hidden);
    // Renormalised top-1 gives every token the weight 1.0: moecore refuses softmax top-1 without
    // pre-softmax (Megatron's rule), and pre-softmax would scale by the probability.
    if (s.topk == 1 && s.norm_topk_prob)
      r.refuse(mixtral ? "num_experts_per_tok" : "norm_topk_prob",
               mixtral ? "1" : "true (with num_experts_per_tok 1)",
               "top-1 with renormalised weights (weight 1.0) has no moecore router mode");
  } else {
    MOE_CHECK(!mixtral, "[convert] '{}': \"num_local_experts\" is 0: a Mixtral needs experts",
              where);
  }

  // Attention options.
  if (s.arch == HfArch::Qwen2Moe) s.qkv_bias = r.boolean("qkv_bias", true);
  if (s.arch == HfArch::Qwen3Moe) {
    s.qk_norm = true;  // Qwen3MoeAttention always has q_norm and k_norm
    // Qwen3MoeAttention.__init__: attention_bias adds a bias to q, k, v and o_proj.
    s.qkv_bias = s.attention_output_bias = r.boolean("attention_bias", false);
  }

  // Qwen2-MoE's shared expert is always gated by sigmoid(x shared_expert_gate^T).
  if (s.arch == HfArch::Qwen2Moe) {
    s.shared_ffn_hidden = r.integer("shared_expert_intermediate_size");
    MOE_CHECK(s.shared_ffn_hidden >= 0,
              "[convert] '{}': \"shared_expert_intermediate_size\" {} must be >= 0", where,
              s.shared_ffn_hidden);
  }
  return s;
}

json hf_config_json(const HfModelSpec& s, const std::string& torch_dtype, const json* carry) {
  json c;
  if (s.arch == HfArch::Gpt2) {
    c = gpt2_config_json(s, torch_dtype);
  } else if (s.arch == HfArch::DeepseekV3) {
    MOE_CHECK(s.deepseek.has_value(), "[convert] a DeepSeek-V3 spec without its DeepSeek part");
    c = deepseek_v3_config_json(*s.deepseek, torch_dtype);
  } else {
    c["architectures"] = json::array({hf_arch_class(s.arch)});
    c["model_type"] = hf_model_type(s.arch);
    c["vocab_size"] = s.vocab_size;
    c["hidden_size"] = s.hidden;
    c["num_hidden_layers"] = s.num_layers;
    c["num_attention_heads"] = s.num_heads;
    c["num_key_value_heads"] = s.num_kv_heads;
    c["head_dim"] = s.head_dim;
    c["intermediate_size"] = s.ffn_hidden;
    c["max_position_embeddings"] = s.max_position_embeddings;
    c["rms_norm_eps"] = s.rms_norm_eps;
    c["rope_parameters"] = {{"rope_theta", s.rope_theta}, {"rope_type", "default"}};
    c["rope_theta"] = s.rope_theta;  // 4.x reads this one
    c["tie_word_embeddings"] = s.tie_word_embeddings;
    c["hidden_act"] = "silu";
    c["attention_dropout"] = 0.0;
    c["num_experts_per_tok"] = s.topk;
    c["dtype"] = torch_dtype;        // 5.x
    c["torch_dtype"] = torch_dtype;  // 4.x
    switch (s.arch) {
      case HfArch::Mixtral:
        c["num_local_experts"] = s.num_experts;
        c["sliding_window"] = nullptr;
        c["router_jitter_noise"] = 0.0;
        break;
      case HfArch::Qwen2Moe:
      case HfArch::Qwen3Moe: {
        c["num_experts"] = s.num_experts;
        if (s.arch == HfArch::Qwen3Moe) c["num_local_experts"] = s.num_experts;
        c["moe_intermediate_size"] = s.moe_ffn_hidden;
        c["norm_topk_prob"] = s.norm_topk_prob;
        // Any pattern: step 1 makes every layer sparse but the listed ones.
        c["decoder_sparse_step"] = 1;
        json only = json::array();
        for (int64_t i = 0; i < s.num_layers; ++i) {
          if (!s.moe_layers[i]) only.push_back(i);
        }
        c["mlp_only_layers"] = only;
        c["use_sliding_window"] = false;
        c["sliding_window"] = nullptr;
        c["max_window_layers"] = s.num_layers;
        if (s.arch == HfArch::Qwen2Moe) {
          c["qkv_bias"] = s.qkv_bias;
          c["shared_expert_intermediate_size"] = s.shared_ffn_hidden;
          c["layer_types"] = json::array();
          for (int64_t i = 0; i < s.num_layers; ++i) c["layer_types"].push_back("full_attention");
        } else {
          c["attention_bias"] = s.attention_output_bias;
        }
        break;
      }
      case HfArch::Gpt2:
      case HfArch::DeepseekV3:
        break;
    }
  }
  // What does not describe the model: the imported values, when there were some.
  static const char* const kCarried[] = {
      "bos_token_id",          "eos_token_id",     "pad_token_id",         "initializer_range",
      "router_aux_loss_coef",  "use_cache",        "output_router_logits", "router_jitter_noise",
      "summary_type",          "summary_use_proj", "summary_activation",   "summary_proj_to_labels",
      "summary_first_dropout", "pretraining_tp"};
  // find, not value(): an imported model_type of another JSON kind must not throw here.
  if (carry != nullptr && carry->is_object() && carry->find("model_type") != carry->end() &&
      *carry->find("model_type") == c["model_type"]) {
    for (const char* k : kCarried) {
      if (carry->contains(k)) c[k] = (*carry)[k];
    }
    // GPT-2's activation keeps the imported spelling when it names the same function
    // (gelu_pytorch_tanh stays gelu_pytorch_tanh rather than becoming gelu_new).
    const auto act = carry->find("activation_function");
    if (s.arch == HfArch::Gpt2 && act != carry->end() && act->is_string() &&
        gpt2_activation(act->get<std::string>()) == s.activation) {
      c["activation_function"] = *act;
    }
  }
  return c;
}

}  // namespace moecore::convert
