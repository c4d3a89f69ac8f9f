// `moecore plan --hf-config`: the model of a HuggingFace config.json, for the families the planner
// models (DeepSeek-V3 with MLA and MTP, Qwen2/3-MoE, Mixtral, Llama-like dense models), more than
// `moecore convert` converts. The keys are read by convert's HfConfigReader, the one reader of
// config.json keys (typed, int64, a bounded layer count), which tests/fuzz/fuzz_hf_config.cpp
// fuzzes through both commands.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "convert/hf_config_reader.h"
#include "core/check.h"
#include "plan/model_spec.h"

namespace moecore::plan {

using nlohmann::json;

ModelSpec spec_from_hf_config(const std::string& path) {
  return spec_from_hf_config(convert::read_hf_config_file(path, "plan", "--hf-config"), path);
}

ModelSpec spec_from_hf_config(const json& j, const std::string& where) {
  const convert::HfConfigReader r(j, where, "plan", "--hf-config");
  ModelSpec m;
  m.name = r.string("model_type", "hf");
  m.vocab_size = m.vocab_unpadded = r.integer("vocab_size", 0);
  m.hidden = r.integer("hidden_size", 0);
  // Before the MoE layer pattern is sized by it.
  m.num_layers = r.has("num_hidden_layers") ? r.num_layers("num_hidden_layers") : 0;
  m.num_heads = r.integer("num_attention_heads", 0);
  MOE_CHECK(m.vocab_size > 0 && m.hidden > 0 && m.num_layers > 0 && m.num_heads > 0,
            "{} lacks a positive vocab_size / hidden_size / num_hidden_layers / "
            "num_attention_heads (it has {}, {}, {}, {})",
            r.label(), m.vocab_size, m.hidden, m.num_layers, m.num_heads);
  m.num_query_groups = r.integer("num_key_value_heads", m.num_heads);
  m.kv_channels = r.integer("head_dim", m.hidden / m.num_heads);
  m.ffn_hidden = r.integer("intermediate_size", 0);
  // The families read here have gated SiLU MLPs (gate_proj / up_proj / down_proj); Llama's
  // config says whether they carry biases.
  m.activation = ops::Activation::SwiGLU;
  m.add_mlp_bias = r.boolean("mlp_bias", false);
  m.max_position_embeddings = r.integer("max_position_embeddings", 4096);
  m.seq_length = std::min<int64_t>(m.max_position_embeddings, 4096);
  m.tie_embeddings = r.boolean("tie_word_embeddings", false);
  m.qk_layernorm = m.name.rfind("qwen3", 0) == 0;
  // Qwen2(-MoE) attention always has q/k/v biases (its config's qkv_bias, true when absent);
  // elsewhere attention_bias puts biases on q, k, v (and o, which moecore does not count).
  m.add_qkv_bias = m.name.rfind("qwen2", 0) == 0 ? r.boolean("qkv_bias", true)
                                                 : r.boolean("attention_bias", false);
  m.num_experts = r.integer({"n_routed_experts", "num_experts", "num_local_experts"}, 0);
  m.topk = r.integer("num_experts_per_tok", 2);
  m.moe_ffn_hidden = r.integer("moe_intermediate_size", m.ffn_hidden);
  // DeepSeek's n_shared_experts of the experts' width, or Qwen2-MoE's one width.
  const int64_t n_shared = r.integer("n_shared_experts", 0);
  const int64_t shared_width = r.integer("shared_expert_intermediate_size", 0);
  MOE_CHECK(!__builtin_mul_overflow(n_shared, m.moe_ffn_hidden, &m.shared_ffn_hidden) &&
                !__builtin_add_overflow(m.shared_ffn_hidden, shared_width, &m.shared_ffn_hidden),
            "{}: n_shared_experts {} x moe_intermediate_size {} + "
            "shared_expert_intermediate_size {} does not fit in 64 bits",
            r.label(), n_shared, m.moe_ffn_hidden, shared_width);
  if (m.num_experts > 0) {
    m.moe_layer_pattern.assign(m.num_layers, 0);
    if (r.has("decoder_sparse_step") || r.has("mlp_only_layers")) {
      // Qwen-MoE (transformers' Qwen2MoeDecoderLayer): layer l is sparse iff l is not in
      // mlp_only_layers and (l + 1) % decoder_sparse_step == 0.
      const int64_t step = std::max<int64_t>(r.integer("decoder_sparse_step", 1), 1);
      std::vector<bool> dense_only(static_cast<size_t>(m.num_layers));
      if (r.has("mlp_only_layers")) {
        const json& only = r.at("mlp_only_layers");
        MOE_CHECK(only.is_array(), "{}: \"mlp_only_layers\" is {}, not a list", r.label(),
                  only.dump());
        for (const json& l : only) {
          MOE_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 &&
                        l.get<int64_t>() < m.num_layers,
                    "{}: \"mlp_only_layers\" holds {}, not a layer of 0..{}", r.label(),
                    l.dump(), m.num_layers - 1);
          dense_only[static_cast<size_t>(l.get<int64_t>())] = true;
        }
      }
      for (int64_t l = 0; l < m.num_layers; ++l) {
        m.moe_layer_pattern[l] = (l + 1) % step == 0 && !dense_only[static_cast<size_t>(l)];
      }
    } else {
      // DeepSeek: layer l is MoE iff l >= first_k_dense_replace and l % moe_layer_freq == 0.
      const int64_t first_dense = r.integer("first_k_dense_replace", 0);
      MOE_CHECK(first_dense >= 0, "{}: \"first_k_dense_replace\" is {}, not a layer count >= 0",
                r.label(), first_dense);
      const int64_t freq = std::max<int64_t>(r.integer("moe_layer_freq", 1), 1);
      for (int64_t l = first_dense; l < m.num_layers; ++l) m.moe_layer_pattern[l] = l % freq == 0;
    }
  }
  if (r.has("kv_lora_rank") && r.at("kv_lora_rank").is_number()) {
    MlaSpec s;
    s.q_lora_rank = r.integer("q_lora_rank", 0);
    s.kv_lora_rank = r.integer("kv_lora_rank", 0);
    s.qk_head_dim = r.integer("qk_nope_head_dim", 128);
    s.qk_pos_emb_head_dim = r.integer("qk_rope_head_dim", 64);
    s.v_head_dim = r.integer("v_head_dim", 128);
    m.mla = s;
    // DeepSeek's q_a_layernorm / kv_a_layernorm: MLA's latent norms, which Megatron's (and
    // moecore's) MLA has with --qk-layernorm.
    m.qk_layernorm = true;
  }
  m.mtp_num_layers = r.integer("num_nextn_predict_layers", 0);
  return m;
}

}  // namespace moecore::plan
