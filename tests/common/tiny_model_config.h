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

}  // namespace moecore::testing
