// The model tests' tiny MoE decoder: an 11-token vocabulary, hidden 8, 4 heads in 2 query groups,
// FFN 6, sequence 5, init std 0.3, 4 experts of width 3 routed top-2; `layers` layers, every one
// MoE unless a test sets moe_layer_pattern. Tests add their own losses, shared experts, ties.
#pragma once

#include <cstdint>

#include "model/config.h"

namespace moecore::testing {

inline ModelConfig tiny_moe_config(int64_t layers = 2) {
  ModelConfig cfg;
  cfg.vocab_size = 11;
  cfg.hidden = 8;
  cfg.num_layers = layers;
  cfg.num_heads = 4;
  cfg.num_query_groups = 2;
  cfg.ffn_hidden = 6;
  cfg.seq_length = 5;
  cfg.init_std = 0.3;
  cfg.num_experts = 4;
  cfg.moe.router.num_experts = 4;
  cfg.moe.router.topk = 2;
  cfg.moe.ffn_hidden = 3;
  return cfg;
}

// Multi-latent attention at the tests' tiny dims: q LoRA rank 6, kv LoRA rank 5, q / k heads of
// 3 + 4 rotary dims, v heads of 5 (narrower than q / k).
inline void use_tiny_mla(ModelConfig& cfg) {
  cfg.multi_latent_attention = true;
  cfg.mla.q_lora_rank = 6;
  cfg.mla.kv_lora_rank = 5;
  cfg.mla.qk_head_dim = 3;
  cfg.mla.qk_pos_emb_head_dim = 4;
  cfg.mla.v_head_dim = 5;
}

}  // namespace moecore::testing
