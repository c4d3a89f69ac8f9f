#include "plan/param_count.h"

namespace moecore::plan {
namespace {

struct AttnParams {
  int64_t matmul = 0, norms = 0;
};

AttnParams attention_params(const ModelSpec& m) {
  const int64_t H = m.hidden, Hq = m.num_heads;
  AttnParams a;
  if (m.mla) {
    // DeepSeek-V3 MLA (Megatron's MLASelfAttention): q down/up (or one q projection), kv down
    // projection to the latent plus the shared rope key, kv up projection to per-head nope keys
    // and values, output projection from the heads' values.
    const MlaSpec& s = *m.mla;
    const int64_t qk = s.qk_head_dim + s.qk_pos_emb_head_dim;
    if (s.q_lora_rank > 0) {
      a.matmul += H * s.q_lora_rank + s.q_lora_rank * Hq * qk;
      a.norms += s.q_lora_rank;  // q_layernorm
    } else {
      a.matmul += H * Hq * qk;
    }
    a.matmul += H * (s.kv_lora_rank + s.qk_pos_emb_head_dim);
    a.norms += s.kv_lora_rank;  // kv_layernorm
    a.matmul += s.kv_lora_rank * Hq * (s.qk_head_dim + s.v_head_dim);
    a.matmul += Hq * s.v_head_dim * H;
    return a;
  }
  const int64_t D = m.kv_channels, Hkv = m.num_query_groups;
  a.matmul = (Hq + 2 * Hkv) * D * H + Hq * D * H;
  if (m.add_qkv_bias) a.norms += (Hq + 2 * Hkv) * D;
  if (m.qk_layernorm) a.norms += 2 * D;
  return a;
}

}  // namespace

LayerParams layer_params(const ModelSpec& m, bool moe_layer) {
  const int64_t H = m.hidden;
  LayerParams p;
  const AttnParams a = attention_params(m);
  p.attention = a.matmul + a.norms;
  p.norms = 2 * H;
  if (moe_layer) {
    p.router = m.num_experts * H;
    p.expert_one = 3 * H * m.moe_ffn_hidden;
    p.experts = m.num_experts * p.expert_one;
    p.shared = 3 * H * m.shared_ffn_hidden;
  } else {
    p.dense_mlp = 3 * H * m.ffn_hidden;
  }
  return p;
}

int64_t layer_matmul_active(const ModelSpec& m, bool moe_layer) {
  const LayerParams p = layer_params(m, moe_layer);
  return attention_params(m).matmul + p.dense_mlp + p.router + p.shared + m.topk * p.expert_one *
                                                                               (moe_layer ? 1 : 0);
}

ParamCounts count_params(const ModelSpec& m) {
  ParamCounts c;
  const int64_t H = m.hidden;
  c.embedding = m.vocab_size * H;
  c.head = m.tie_embeddings ? 0 : m.vocab_size * H;
  c.final_norm = H;
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
  const int64_t extra = 2 * H + 2 * H * H + H;
  c.mtp_total = m.mtp_num_layers * (extra + p.total());
  c.mtp_active = m.mtp_num_layers * (extra + p.active(moe ? m.topk : 0));
  return c;
}

}  // namespace moecore::plan
