// The flags of the small model many tests train, stated in full (the command line starts from
// Megatron's defaults, which need --num-layers, --swiglu, ... given): the values configs/tiny.toml
// gives, except that the embeddings stay tied; each test overrides what it varies.
#pragma once

#include "cli/train_flags.h"

namespace moecore::cli {

inline TrainFlags tiny_train_flags() {
  TrainFlags f;
  ModelConfig& m = f.model;
  f.vocab_size = 256;
  f.swiglu = true;
  f.disable_bias_linear = true;
  f.normalization = "RMSNorm";
  f.position_embedding_type = "rope";
  m.hidden_dropout = 0;
  m.attention_dropout = 0;
  m.hidden = 64;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_query_groups = 4;
  m.ffn_hidden = 256;
  m.seq_length = 64;
  m.max_position_embeddings = 64;
  m.norm_eps = 1e-5;
  m.init_std = 0.02;
  m.num_experts = 8;
  m.moe.ffn_hidden = 64;
  m.moe.shared_ffn_hidden = 0;
  m.moe.router.topk = 2;
  m.moe.router.aux_loss_coeff = 0.01;
  f.router.token_dispatcher_type = "alltoall";
  f.router.router_dtype = "fp32";
  TrainConfig& t = f.train;
  t.micro_batch = 8;
  t.global_batch = 16;
  t.train_iters = 300;
  t.log_interval = 25;
  t.lr.max_lr = 3e-3;
  t.lr.min_lr = 3e-4;
  t.lr.warmup_steps = 20;
  f.lr_decay_style = "cosine";
  t.adam.weight_decay = 0.01;
  t.adam.beta2 = 0.95;
  return f;
}

// The same model as Megatron builds it without the tiny model's flags: GeLU MLPs, biases on
// every linear layer, LayerNorm, learned absolute positions, dropout 0.1 on the hidden states
// and the attention probabilities.
inline TrainFlags megatron_model_train_flags() {
  TrainFlags f = tiny_train_flags();
  f.swiglu = false;
  f.disable_bias_linear = false;
  f.normalization = "LayerNorm";
  f.position_embedding_type = "learned_absolute";
  f.model.hidden_dropout = 0.1;
  f.model.attention_dropout = 0.1;
  return f;
}

}  // namespace moecore::cli
