#include "plan/param_count.h"

#include "ops/activation.h"

namespace moecore::plan {
namespace {

struct AttnParams {
  int64_t matmul = 0, norms = 0;
  // Whole on every TP rank besides the output projection's bias: qk-layernorm's weights; MLA's
  // down projections and the latents' norms.
  int64_t tp_replicated = 0;
};

AttnParams attention_params(const ModelSpec& m) {
  const int64_t H = m.hidden, Hq = m.num_heads;
  AttnParams a;
  if (m.mla) {
    // DeepSeek-V3 MLA (Megatron's MLASelfAttention): q down/up (or one q projection), kv down
    // projection to the latent plus the shared rope key, kv up projection to per-head nope keys
    // and values, output projection from the heads' values.
    // The latents' norms exist with --qk-layernorm (Megatron's layer spec); linear_proj has
    // --add-bias-linear's bias (its only one). Under TP the down projections and the norms are
    // replicated, the up projections and linear_proj split over the heads.
    const MlaSpec& s = *m.mla;
    const int64_t qk = s.qk_head_dim + s.qk_pos_emb_head_dim;
    const int64_t norm = m.qk_layernorm ? 1 : 0;
    if (s.q_lora_rank > 0) {
      a.matmul += H * s.q_lora_rank + s.q_lora_rank * Hq * qk;
      a.norms += norm * s.q_lora_rank;  // q_layernorm
      a.tp_replicated += H * s.q_lora_rank + norm * s.q_lora_rank;
    } else {
      a.matmul += H * Hq * qk;
    }
    a.matmul += H * (s.kv_lora_rank + s.qk_pos_emb_head_dim);
    a.norms += norm * s.kv_lora_rank;  // kv_layernorm
    a.tp_replicated += H * (s.kv_lora_rank + s.qk_pos_emb_head_dim) + norm * s.kv_lora_rank;
    a.matmul += s.kv_lora_rank * Hq * (s.qk_head_dim + s.v_head_dim);
    a.matmul += Hq * s.v_head_dim * H;
    if (m.add_attention_output_bias) a.norms += H;
    return a;
  }
  const int64_t D = m.kv_channels, Hkv = m.num_query_groups;
  a.matmul = (Hq + 2 * Hkv) * D * H + Hq * D * H;
  if (m.add_qkv_bias) a.norms += (Hq + 2 * Hkv) * D;
  if (m.add_attention_output_bias) a.norms += H;
  if (m.qk_layernorm) a.norms += 2 * D;
  if (m.qk_layernorm) a.tp_replicated += 2 * D;
  return a;
}

// An MLP of width F: fc1 [F1, H] (F1 = 2F gated) and fc2 [H, F]; with biases F1 + H more.
int64_t mlp_matmul(const ModelSpec& m, int64_t F) {
  return (ops::activation_fc1_width(m.activation, F) + F) * m.hidden;
}
int64_t mlp_params(const ModelSpec& m, int64_t F) {
  return mlp_matmul(m, F) +
         (m.add_mlp_bias ? ops::activation_fc1_width(m.activation, F) + m.hidden : 0);
}

}  // namespace

LayerParams layer_params(const ModelSpec& m, bool moe_layer) {
  const int64_t H = m.hidden;
  LayerParams p;
  const AttnParams a = attention_params(m);
  p.attention = a.matmul + a.norms;
  p.norms = (m.layernorm ? 4 : 2) * H;  // two norms, LayerNorm with a bias each
  const int64_t fc2_bias = m.add_mlp_bias ? H : 0;
  p.tp_replicated = p.norms + (m.add_attention_output_bias ? H : 0) + a.tp_replicated;
  if (moe_layer) {
    p.router = m.num_experts * H;
    p.expert_one = mlp_params(m, m.moe_ffn_hidden);
    p.experts = m.num_experts * p.expert_one;
    p.shared = m.shared_ffn_hidden > 0 ? mlp_params(m, m.shared_ffn_hidden) : 0;
    p.tp_replicated += p.router + (m.shared_ffn_hidden > 0 ? fc2_bias : 0);
    p.experts_etp_replicated = m.num_experts * fc2_bias;
  } else {
    p.dense_mlp = mlp_params(m, m.ffn_hidden);
    p.tp_replicated += fc2_bias;
  }
  return p;
}

int64_t layer_matmul_active(const ModelSpec& m, bool moe_layer) {
  const int64_t attn = attention_params(m).matmul;
  if (!moe_layer) return attn + mlp_matmul(m, m.ffn_hidden);
  return attn + m.num_experts * m.hidden + mlp_matmul(m, m.shared_ffn_hidden) +
         m.topk * mlp_matmul(m, m.moe_ffn_hidden);
}

ParamCounts count_params(const ModelSpec& m) {
  ParamCounts c;
  const int64_t H = m.hidden;
  c.embedding = m.vocab_size * H + (m.learned_positions ? m.max_position_embeddings * H : 0);
  c.positions = m.learned_positions ? m.max_position_embeddings * H : 0;
  c.head = m.tie_embeddings ? 0 : m.vocab_size * H;
  c.final_norm = (m.layernorm ? 2 : 1) * H;
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const bool moe = m.is_moe_layer(l);
    const LayerParams p = layer_params(m, moe);
    c.decoder_dense += p.dense();
    c.decoder_experts += p.experts;
    c.decoder_active += p.active(moe ? m.topk : 0);
  }
  // Megatron's MTP layer (DeepSeek-V3): enorm, hnorm, eh_proj [H, 2H], a transformer layer of
  // the last decoder layer's kind, final_layernorm; embedding and output layer shared.
  const bool moe = m.num_layers > 0 && m.is_moe_layer(m.num_layers - 1);
  const LayerParams p = layer_params(m, moe);
  const int64_t extra = 3 * c.final_norm + 2 * H * H;  // enorm, hnorm, final_layernorm, eh_proj
  c.mtp_total = m.mtp_num_layers * (extra + p.total());
  c.mtp_active = m.mtp_num_layers * (extra + p.active(moe ? m.topk : 0));
  return c;
}

}  // namespace moecore::plan
