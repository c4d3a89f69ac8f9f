#include "convert/model_flags.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <cmath>
#include <sstream>
#include <string_view>

#include "core/check.h"

namespace moecore::convert {

namespace {

// GPT-2 is Megatron's default GPT: LayerNorm, learned absolute positions, the GeLU MLP and
// biases on every linear layer are what Megatron builds without --swiglu, --disable-bias-linear,
// --normalization RMSNorm or --position-embedding-type rope; the flags name them anyway, so the
// file says what the model is.
std::vector<TrainFlag> gpt2_train_flags(const HfModelSpec& s) {
  std::vector<TrainFlag> f = {
      {"num-layers", s.num_layers},
      {"hidden-size", s.hidden},
      {"ffn-hidden-size", s.ffn_hidden},
      {"num-attention-heads", s.num_heads},
      {"kv-channels", s.head_dim},
      {"max-position-embeddings", s.max_position_embeddings},
      {"vocab-size", s.vocab_size},
      {"make-vocab-size-divisible-by", int64_t{1}},
      {"normalization", std::string("LayerNorm")},
      {"norm-epsilon", s.rms_norm_eps},
      {"position-embedding-type", std::string("learned_absolute")},
  };
  // gelu_new is the tanh form: Megatron's --openai-gelu; gelu the exact one, its default.
  if (s.activation == ops::Activation::GeLUTanh) f.push_back({"openai-gelu", true});
  f.push_back({"attention-dropout", s.attention_dropout});
  f.push_back({"hidden-dropout", s.hidden_dropout});
  if (!s.tie_word_embeddings) f.push_back({"untie-embeddings-and-output-weights", true});
  return f;
}

// Megatron's --rotary-base is an integer flag; HF's thetas are integral in practice.
TrainFlag rotary_base(double theta) {
  if (std::floor(theta) == theta && theta < 9e15) {
    return {"rotary-base", static_cast<int64_t>(theta)};
  }
  return {"rotary-base", theta};
}

// DeepSeek-V3 (docs/hf_interop.md, section 11): multi-latent attention with its q / kv
// layernorms, YaRN, sigmoid routing with the expert bias over groups, the top-k scaling factor,
// an ungated shared expert, first_k_dense_replace dense layers and the MTP layers.
std::vector<TrainFlag> deepseek_v3_train_flags(const DeepseekV3Spec& d) {
  std::vector<TrainFlag> f = {
      {"num-layers", d.num_layers},
      {"hidden-size", d.hidden},
      {"ffn-hidden-size", d.ffn_hidden},
      {"num-attention-heads", d.num_heads},
      {"max-position-embeddings", d.max_position_embeddings},
      {"vocab-size", d.vocab_size},
      {"make-vocab-size-divisible-by", int64_t{1}},
      {"normalization", std::string("RMSNorm")},
      {"norm-epsilon", d.rms_norm_eps},
      {"position-embedding-type", std::string("rope")},
      {"swiglu", true},
      {"disable-bias-linear", true},
      {"attention-dropout", d.attention_dropout},
      {"hidden-dropout", 0.0},
      rotary_base(d.rope_theta),
  };
  if (!d.tie_word_embeddings) f.push_back({"untie-embeddings-and-output-weights", true});
  // Megatron's MLA has its q_layernorm (with q LoRA) and kv_layernorm only with --qk-layernorm,
  // as DeepSeek-V3's q_a_layernorm and kv_a_layernorm.
  f.push_back({"multi-latent-attention", true});
  f.push_back({"qk-layernorm", true});
  if (d.q_lora_rank) f.push_back({"q-lora-rank", *d.q_lora_rank});
  f.push_back({"kv-lora-rank", d.kv_lora_rank});
  f.push_back({"qk-head-dim", d.qk_nope_head_dim});
  f.push_back({"qk-pos-emb-head-dim", d.qk_rope_head_dim});
  f.push_back({"v-head-dim", d.v_head_dim});
  if (d.rope_factor > 0) {
    // transformers scales cos and sin by get_mscale(factor, mscale) / get_mscale(factor,
    // mscale_all_dim) only when both are set, else by get_mscale(factor) (mscale 1); Megatron
    // always divides, by get_mscale(factor, 0) = 1 when mscale_all_dim is 0
    // (parse_deepseek_v3_config refuses the one case without a spelling).
    const double mscale = d.mscale != 0 && d.mscale_all_dim != 0 ? d.mscale : 1.0;
    f.push_back({"rope-type", std::string("yarn")});
    f.push_back({"rotary-scaling-factor", d.rope_factor});
    f.push_back({"mscale", mscale});
    f.push_back({"mscale-all-dim", d.mscale_all_dim});
    f.push_back({"yarn-beta-fast", d.beta_fast});
    f.push_back({"yarn-beta-slow", d.beta_slow});
    // Absent in config.json: transformers takes max_position_embeddings.
    const int64_t original = d.original_max_position_embeddings > 0
                                 ? d.original_max_position_embeddings
                                 : d.max_position_embeddings;
    f.push_back({"yarn-original-max-position-embeddings", original});
  } else {
    f.push_back({"rope-type", std::string("rope")});  // Megatron's None is yarn for MLA
  }
  f.push_back({"num-experts", d.num_experts});
  f.push_back({"moe-ffn-hidden-size", d.moe_ffn_hidden});
  f.push_back({"moe-router-topk", d.topk});
  // e_score_correction_bias is the expert bias: it steers the choice, the weights are the
  // unbiased sigmoid scores, renormalised when K > 1 (norm_topk_prob), then scaled.
  f.push_back({"moe-router-score-function", std::string("sigmoid")});
  f.push_back({"moe-router-enable-expert-bias", true});
  if (d.group_topk < d.num_groups) {  // all groups kept: no limit
    f.push_back({"moe-router-num-groups", d.num_groups});
    f.push_back({"moe-router-group-topk", d.group_topk});
  }
  f.push_back({"moe-router-topk-scaling-factor", d.routed_scaling_factor});
  if (d.num_shared_experts > 0)
    f.push_back({"moe-shared-expert-intermediate-size", d.num_shared_experts * d.moe_ffn_hidden});
  std::string pattern = "[";
  for (int64_t i = 0; i < d.num_layers; ++i)
    pattern += fmt::format("{}{}", i ? "," : "", i < d.first_k_dense ? 0 : 1);
  f.push_back({"moe-layer-freq", pattern + "]"});
  if (d.mtp_layers > 0) f.push_back({"mtp-num-layers", d.mtp_layers});
  return f;
}

}  // namespace

std::vector<TrainFlag> train_flags_of(const HfModelSpec& s) {
  if (s.arch == HfArch::Gpt2) return gpt2_train_flags(s);
  if (s.arch == HfArch::DeepseekV3) {
    MOE_CHECK(s.deepseek.has_value(), "[convert] a DeepSeek-V3 spec without its DeepSeek part");
    return deepseek_v3_train_flags(*s.deepseek);
  }
  std::vector<TrainFlag> f = {
      {"num-layers", s.num_layers},
      {"hidden-size", s.hidden},
      {"ffn-hidden-size", s.ffn_hidden},
      {"num-attention-heads", s.num_heads},
      {"group-query-attention", true},
      {"num-query-groups", s.num_kv_heads},
      {"kv-channels", s.head_dim},
      {"max-position-embeddings", s.max_position_embeddings},
      {"vocab-size", s.vocab_size},
      // HF's vocabulary exactly, no padding rows in the written tables (padding is never part of
      // the model: a run at any TP pads its own).
      {"make-vocab-size-divisible-by", int64_t{1}},
      {"normalization", std::string("RMSNorm")},
      {"norm-epsilon", s.rms_norm_eps},
      {"position-embedding-type", std::string("rope")},
      {"swiglu", true},
      {"disable-bias-linear", true},
      {"attention-dropout", 0.0},
      {"hidden-dropout", 0.0},
  };
  f.push_back(rotary_base(s.rope_theta));
  // Megatron's default is tied: an untied HF model must say so.
  if (!s.tie_word_embeddings) f.push_back({"untie-embeddings-and-output-weights", true});
  if (s.qkv_bias) f.push_back({"add-qkv-bias", true});
  if (s.attention_output_bias) f.push_back({"add-attention-output-bias", true});
  if (s.qk_norm) f.push_back({"qk-layernorm", true});
  if (s.num_experts > 0) {
    f.push_back({"num-experts", s.num_experts});
    f.push_back({"moe-ffn-hidden-size", s.moe_ffn_hidden});
    f.push_back({"moe-router-topk", s.topk});
    f.push_back({"moe-router-score-function", std::string("softmax")});
    // norm_topk_prob (Mixtral: always) is moecore's plain softmax router: softmax over the K
    // chosen logits. Without it, the K probabilities of the softmax over E: pre-softmax.
    if (!s.norm_topk_prob) f.push_back({"moe-router-pre-softmax", true});
    std::string pattern = "[";
    for (size_t i = 0; i < s.moe_layers.size(); ++i)
      pattern += fmt::format("{}{}", i ? "," : "", s.moe_layers[i]);
    f.push_back({"moe-layer-freq", pattern + "]"});
    // Qwen2-MoE's shared expert is always gated: sigmoid(x shared_expert_gate^T).
    if (s.shared_ffn_hidden > 0) {
      f.push_back({"moe-shared-expert-intermediate-size", s.shared_ffn_hidden});
      f.push_back({"moe-shared-expert-gate", true});
    }
  }
  return f;
}

std::string flags_toml(const std::vector<TrainFlag>& flags, const std::string& comment) {
  std::ostringstream os;
  std::istringstream lines(comment);
  for (std::string line; std::getline(lines, line);) os << "# " << line << "\n";
  // One table per flag keeps the flags in their order (a toml::table sorts its keys).
  for (const TrainFlag& f : flags) {
    if (const double* d = std::get_if<double>(&f.value)) {
      // The shortest text that reads back as the same double (toml++ prints 17 digits:
      // 1.0000000000000001e-05 for HF's 1e-05), kept a TOML float.
      std::string text = fmt::format("{}", *d);
      if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
      os << f.name << " = " << text << "\n";
      continue;
    }
    toml::table t;
    std::visit([&](const auto& v) { t.insert_or_assign(f.name, v); }, f.value);
    os << t << "\n";
  }
  return os.str();
}

cli::TrainFlags parse_model_flags(const std::vector<std::string>& args) {
  // Placeholders first: the flags given after them win (argparse's last occurrence).
  std::vector<std::string> all = {"--seq-length=1"};
  const std::vector<std::string>& no_step = cli::no_step_placeholder_args();
  all.insert(all.end(), no_step.begin(), no_step.end());
  all.insert(all.end(), args.begin(), args.end());
  cli::TrainFlags f = cli::parse_train_args(all);
  return f;
}

HfArch default_hf_arch(const ModelConfig& m) {
  if (m.multi_latent_attention) return HfArch::DeepseekV3;
  if (m.normalization == Normalization::LayerNorm ||
      m.position_embedding == PositionEmbedding::LearnedAbsolute)
    return HfArch::Gpt2;
  if (m.qk_layernorm) return HfArch::Qwen3Moe;
  if (m.moe.shared_ffn_hidden > 0 || m.add_qkv_bias) return HfArch::Qwen2Moe;
  if (m.num_experts > 0 && !m.has_dense_layer() && !m.moe.router.pre_softmax)
    return HfArch::Mixtral;
  return HfArch::Qwen2Moe;
}

namespace {

// GPT2LMHeadModel: what it cannot express is refused through `refuse` (naming the class).
template <typename Refuse>
HfModelSpec gpt2_spec_of_model(const ModelConfig& m, const Refuse& refuse) {
  if (m.num_experts > 0)
    refuse(
        fmt::format("it has experts (--num-experts {}): GPT-2 is dense (export with --arch "
                    "mixtral, qwen2_moe or qwen3_moe)",
                    m.num_experts));
  if (m.normalization != Normalization::LayerNorm)
    refuse("--normalization RMSNorm: GPT-2's norms are LayerNorm");
  if (m.layernorm_1p)
    refuse("--apply-layernorm-1p: GPT-2 stores the LayerNorm gain itself, not gain - 1");
  if (m.position_embedding != PositionEmbedding::LearnedAbsolute)
    refuse(fmt::format("--position-embedding-type {}: GPT-2 has a learned position table",
                       m.position_embedding == PositionEmbedding::Rope ? "rope" : "none"));
  if (m.activation != ops::Activation::GeLUTanh && m.activation != ops::Activation::GeLU)
    refuse(fmt::format("the {} MLP: GPT-2's activation is gelu_new (--openai-gelu) or gelu",
                       ops::activation_name(m.activation)));
  if (!m.add_mlp_bias || !m.add_qkv_bias || !m.add_attention_output_bias)
    refuse(
        "a linear layer without its bias (--disable-bias-linear or a part of it): every GPT-2 "
        "linear layer has one");
  if (m.qk_layernorm) refuse("--qk-layernorm: GPT-2 has no q/k norms");
  if (m.num_query_groups != m.num_heads)
    refuse(fmt::format("--num-query-groups {} of {} heads: GPT-2 has no grouped-query attention",
                       m.num_query_groups, m.num_heads));
  if (m.head_dim() * m.num_heads != m.hidden)
    refuse(fmt::format("--kv-channels {}: GPT-2's head dim is hidden / heads = {}", m.head_dim(),
                       m.hidden / m.num_heads));
  HfModelSpec s;
  s.arch = HfArch::Gpt2;
  s.vocab_size = m.vocab_size;  // the model's: its padding rows are no part of it
  s.hidden = m.hidden;
  s.num_layers = m.num_layers;
  s.moe_layers.assign(static_cast<size_t>(m.num_layers), 0);  // every layer dense
  s.num_heads = m.num_heads;
  s.num_kv_heads = m.num_heads;
  s.head_dim = m.head_dim();
  s.ffn_hidden = m.ffn_hidden;
  s.rms_norm_eps = m.norm_eps;
  s.max_position_embeddings = m.max_positions();
  s.tie_word_embeddings = m.tie_embeddings;
  s.qkv_bias = s.attention_output_bias = s.mlp_bias = true;
  s.layernorm = s.learned_positions = true;
  s.activation = m.activation;
  s.attention_dropout = m.attention_dropout;
  s.hidden_dropout = m.hidden_dropout;
  return s;
}

// DeepseekV3ForCausalLM: what it cannot express is refused through `refuse`.
template <typename Refuse>
HfModelSpec deepseek_v3_spec_of_model(const ModelConfig& m, const Refuse& refuse) {
  const RouterConfig& rc = m.moe.router;
  if (!m.multi_latent_attention)
    refuse("its attention is not multi-latent (--multi-latent-attention): DeepSeek-V3's is");
  if (!m.qk_layernorm)
    refuse(
        "no --qk-layernorm: DeepSeek-V3's MLA always has q_a_layernorm and kv_a_layernorm "
        "(weights of ones are not the identity)");
  if (m.normalization != Normalization::RMSNorm)
    refuse("--normalization LayerNorm: it uses RMSNorm");
  if (m.position_embedding != PositionEmbedding::Rope)
    refuse("no --position-embedding-type rope: MLA's keys and queries are rotated");
  if (m.activation != ops::Activation::SwiGLU)
    refuse(fmt::format("the {} MLP: its MLPs are SwiGLU (--swiglu)",
                       ops::activation_name(m.activation)));
  if (m.add_mlp_bias) refuse("MLP biases: its MLPs have none (--disable-bias-linear)");
  if (m.num_experts == 0) refuse("it has no experts (--num-experts 0)");
  if (rc.score != ScoreFunction::Sigmoid)
    refuse(fmt::format("--moe-router-score-function {}: DeepSeek-V3's router is sigmoid",
                       score_function_name(rc.score)));
  if (!rc.enable_expert_bias)
    refuse(
        "no --moe-router-enable-expert-bias: DeepSeek-V3's router always has its "
        "e_score_correction_bias");
  if (!rc.dropless())
    refuse(fmt::format("--moe-expert-capacity-factor {} (HF's MoE blocks drop no token)",
                       rc.capacity_factor));
  if (m.moe.shared_expert_gate) refuse("--moe-shared-expert-gate: its shared expert is ungated");
  const int64_t F = m.moe.ffn_hidden, S = m.moe.shared_ffn_hidden;
  if (S == 0 || S % F != 0)
    refuse(
        fmt::format("--moe-shared-expert-intermediate-size {}: DeepSeek-V3's shared experts are "
                    "n_shared_experts >= 1 of --moe-ffn-hidden-size {}",
                    S, F));
  DeepseekV3Spec d;
  d.first_k_dense = 0;
  while (d.first_k_dense < m.num_layers && !m.is_moe_layer(d.first_k_dense)) ++d.first_k_dense;
  for (int64_t l = d.first_k_dense; l < m.num_layers; ++l) {
    if (!m.is_moe_layer(l))
      refuse(fmt::format(
          "dense layer {} after MoE layers (--moe-layer-freq): DeepSeek-V3's dense layers are the "
          "first first_k_dense_replace",
          l));
  }
  d.vocab_size = m.vocab_size;  // the model's: its padding rows are no part of it
  d.hidden = m.hidden;
  d.num_layers = m.num_layers;
  d.num_heads = m.num_heads;
  d.ffn_hidden = m.ffn_hidden;
  d.moe_ffn_hidden = F;
  d.num_experts = m.num_experts;
  d.topk = rc.topk;
  d.num_shared_experts = S / F;
  if (rc.group_limited() && rc.group_topk < rc.num_groups && rc.topk / rc.group_topk != 2)
    refuse(fmt::format(
        "--moe-router-group-topk {} with --moe-router-topk {}: moecore scores a group by the sum "
        "of its top {} biased scores, transformers' DeepseekV3MoE by its top 2, so they keep "
        "other groups for some tokens; a model routed with --moe-router-topk = 2 x "
        "--moe-router-group-topk (or without group limits) exports as the same model",
        rc.group_topk, rc.topk, rc.topk / rc.group_topk));
  d.num_groups = rc.group_limited() ? rc.num_groups : 1;
  d.group_topk = rc.group_limited() ? rc.group_topk : 1;
  d.norm_topk_prob = rc.topk > 1;  // Megatron's sigmoid router renormalises exactly then
  d.routed_scaling_factor = rc.topk_scaling_factor;
  if (m.mla.q_lora_rank > 0) d.q_lora_rank = m.mla.q_lora_rank;
  d.kv_lora_rank = m.mla.kv_lora_rank;
  d.qk_nope_head_dim = m.mla.qk_head_dim;
  d.qk_rope_head_dim = m.mla.qk_pos_emb_head_dim;
  d.v_head_dim = m.mla.v_head_dim;
  d.rms_norm_eps = m.norm_eps;
  d.rope_theta = m.rotary_base;
  d.attention_dropout = m.attention_dropout;
  d.max_position_embeddings = m.max_positions();
  d.tie_word_embeddings = m.tie_embeddings;
  const ops::YarnParams& y = m.mla.yarn;
  // YaRN of factor 1 is the plain rotary (the same frequencies, no mscale): written as
  // transformers' default, which no version reads differently.
  if (m.mla.rope_type == ops::RopeType::Yarn && y.scaling_factor != 1.0) {
    const double f = y.scaling_factor;
    // transformers: cos and sin times get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)
    // when both are non-zero, else times get_mscale(f) (mscale 1).
    if (f > 1 && (y.mscale_all_dim == 0 ? y.mscale != 1.0 : y.mscale == 0))
      refuse(fmt::format(
          "--mscale {} --mscale-all-dim {}: transformers' YaRN scales cos and sin by "
          "get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) only when both are "
          "non-zero, and by get_mscale(factor) otherwise",
          y.mscale, y.mscale_all_dim));
    const double ratio = static_cast<double>(d.max_position_embeddings) /
                         static_cast<double>(y.original_max_position_embeddings);
    if (ratio != f)
      refuse(fmt::format(
          "--rotary-scaling-factor {} is not --max-position-embeddings / "
          "--yarn-original-max-position-embeddings = {} / {}: transformers versions take one or "
          "the other as YaRN's factor (set --max-position-embeddings {})",
          f, d.max_position_embeddings, y.original_max_position_embeddings,
          static_cast<int64_t>(f * static_cast<double>(y.original_max_position_embeddings))));
    d.rope_factor = f;
    d.mscale = y.mscale;
    d.mscale_all_dim = y.mscale_all_dim;
    d.beta_fast = y.beta_fast;
    d.beta_slow = y.beta_slow;
    d.original_max_position_embeddings = y.original_max_position_embeddings;
  }
  d.rope_interleave = true;  // moecore's pairing (export_hf keeps an imported checkpoint's)
  d.mtp_layers = m.mtp_num_layers;
  return hf_spec_of_deepseek_v3(d);
}

}  // namespace

HfModelSpec hf_spec_of_model(const ModelConfig& m, HfArch arch) {
  const char* cls = hf_arch_class(arch);
  auto refuse = [&](const std::string& what) {
    MOE_FAIL("[convert] this moecore model cannot be written as {}: {}", cls, what);
  };
  const RouterConfig& rc = m.moe.router;
  if (arch == HfArch::DeepseekV3) return deepseek_v3_spec_of_model(m, refuse);
  if (m.multi_latent_attention)
    refuse("multi-latent attention (--multi-latent-attention): export with --arch deepseek_v3");
  if (m.mtp_num_layers > 0)
    refuse(fmt::format("{} multi-token prediction depth(s) (--mtp-num-layers): only DeepSeek-V3 "
                       "stores MTP layers (export with --arch deepseek_v3)",
                       m.mtp_num_layers));
  if (arch == HfArch::Gpt2) return gpt2_spec_of_model(m, refuse);
  // What only GPT-2 has among HF's classes here.
  if (m.normalization != Normalization::RMSNorm)
    refuse("--normalization LayerNorm: its classes use RMSNorm (export with --arch gpt2)");
  if (m.position_embedding != PositionEmbedding::Rope)
    refuse(fmt::format(
        "--position-embedding-type {}: its classes use RoPE{}",
        m.position_embedding == PositionEmbedding::None ? "none" : "learned_absolute",
        m.position_embedding == PositionEmbedding::None ? "" : " (export with --arch gpt2)"));
  // HF's MoE families have gated SiLU MLPs without biases (gate_proj / up_proj / down_proj).
  if (m.activation != ops::Activation::SwiGLU)
    refuse(fmt::format("the {} MLP: its MLPs are SwiGLU (--swiglu)",
                       ops::activation_name(m.activation)));
  if (m.add_mlp_bias) refuse("MLP biases: its MLPs have none (--disable-bias-linear)");
  if (m.num_experts > 0) {
    // What none of HF's three routers computes: softmax scores, plain top-k, weights as they
    // come, no token dropped.
    if (rc.score != ScoreFunction::Softmax)
      refuse(fmt::format("--moe-router-score-function {} (HF's routers are softmax)",
                         score_function_name(rc.score)));
    if (rc.group_limited())
      refuse(fmt::format(
          "group-limited routing (--moe-router-num-groups {} --moe-router-group-topk {}): HF's "
          "routers choose among all experts",
          rc.num_groups, rc.group_topk));
    if (rc.topk_scaling_factor != 1.0)
      refuse(fmt::format("--moe-router-topk-scaling-factor {} (HF scales by 1)",
                         rc.topk_scaling_factor));
    if (!rc.dropless())
      refuse(fmt::format("--moe-expert-capacity-factor {} (HF's MoE blocks drop no token)",
                         rc.capacity_factor));
  }
  HfModelSpec s;
  s.arch = arch;
  s.vocab_size = m.vocab_size;  // the model's: its padding rows are no part of it
  s.hidden = m.hidden;
  s.num_layers = m.num_layers;
  s.num_heads = m.num_heads;
  s.num_kv_heads = m.num_query_groups;
  s.head_dim = m.head_dim();
  s.ffn_hidden = m.ffn_hidden;
  s.num_experts = m.num_experts;
  s.topk = m.num_experts > 0 ? rc.topk : 0;
  s.moe_ffn_hidden = m.num_experts > 0 ? m.moe.ffn_hidden : 0;
  s.shared_ffn_hidden = m.num_experts > 0 ? m.moe.shared_ffn_hidden : 0;
  s.norm_topk_prob = !rc.pre_softmax;
  for (int64_t l = 0; l < m.num_layers; ++l) s.moe_layers.push_back(m.is_moe_layer(l) ? 1 : 0);
  s.rms_norm_eps = m.norm_eps;
  s.rope_theta = m.rotary_base;
  s.max_position_embeddings = m.max_positions();
  s.tie_word_embeddings = m.tie_embeddings;
  s.qkv_bias = m.add_qkv_bias;
  s.attention_output_bias = m.add_attention_output_bias;
  s.qk_norm = m.qk_layernorm;

  if (s.shared_ffn_hidden > 0 && arch != HfArch::Qwen2Moe)
    refuse(fmt::format(
        "a shared expert (--moe-shared-expert-intermediate-size {}): only Qwen2-MoE has one "
        "(export with --arch qwen2_moe)",
        s.shared_ffn_hidden));
  if (s.shared_ffn_hidden > 0 && !m.moe.shared_expert_gate)
    refuse("a shared expert without --moe-shared-expert-gate: Qwen2-MoE always gates it");
  if (s.attention_output_bias && arch != HfArch::Qwen3Moe)
    refuse(
        "--add-attention-output-bias: only Qwen3-MoE (attention_bias) has an o_proj bias (export "
        "with --arch qwen3_moe)");
  switch (arch) {
    case HfArch::Mixtral:
      if (s.num_experts == 0) refuse("it has no experts (--num-experts 0)");
      if (m.has_dense_layer())
        refuse(fmt::format(
            "--moe-layer-freq has dense layers ([{}]); every Mixtral layer is MoE (export with "
            "--arch qwen2_moe or qwen3_moe)",
            fmt::join(s.moe_layers, ",")));
      if (rc.pre_softmax)
        refuse(
            "--moe-router-pre-softmax: Mixtral always renormalises the top-k weights (export "
            "with --arch qwen2_moe or qwen3_moe: norm_topk_prob false)");
      if (s.qkv_bias)
        refuse("--add-qkv-bias: Mixtral has no attention biases (export with --arch qwen2_moe)");
      if (s.qk_norm)
        refuse("--qk-layernorm: Mixtral has no q/k norms (export with --arch qwen3_moe)");
      // MixtralExperts read intermediate_size.
      s.ffn_hidden = s.moe_ffn_hidden;
      break;
    case HfArch::Qwen2Moe:
      if (s.qk_norm)
        refuse("--qk-layernorm: Qwen2-MoE has no q/k norms (export with --arch qwen3_moe)");
      break;
    case HfArch::Qwen3Moe:
      if (!s.qk_norm)
        refuse(
            "no --qk-layernorm: Qwen3-MoE always has q/k norms (weights of ones are not the "
            "identity; export with --arch mixtral or qwen2_moe)");
      if (s.qkv_bias != s.attention_output_bias)
        refuse(
            "--add-qkv-bias without --add-attention-output-bias or the reverse: Qwen3-MoE's "
            "attention_bias adds both");
      break;
    case HfArch::Gpt2:  // gpt2_spec_of_model above
    case HfArch::DeepseekV3:  // deepseek_v3_spec_of_model above
      break;
  }
  if (s.num_experts > 0 && s.topk == 1 && s.norm_topk_prob)
    refuse("top-1 without --moe-router-pre-softmax");  // moecore refuses it too
  return s;
}

}  // namespace moecore::convert
