// The flags of the small model many tests train, stated in full (the command line starts from
// Megatron's defaults, which need --num-layers, --swiglu, ... given): the values configs/tiny.toml
// gives, except that the embeddings stay tied; each test overrides what it varies.
#pragma once

#include <string>
#include <vector>

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

// Four layers (MoE, dense, MoE, MoE) of hidden 32 over sequences of 16, 4 experts with a z-loss
// and input jitter, 2 micro-batches of 2 per step, no warm-up and no GEMM probe: the training
// tests that step a whole model through its MoE and dense layers (recomputation, routing replay).
inline TrainFlags small_moe_train_flags() {
  TrainFlags f = tiny_train_flags();
  f.vocab_size = 64;
  f.make_vocab_size_divisible_by = 64;
  f.model.hidden = 32;
  f.model.num_layers = 4;
  f.model.seq_length = 16;
  f.model.ffn_hidden = 48;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 24;
  f.model.moe.router.z_loss_coeff = 1e-3;
  f.model.moe.router.input_jitter_eps = 1e-2;
  f.moe_layer_freq = "[1,0,1,1]";
  f.train.micro_batch = 2;
  f.train.global_batch = 4;
  f.train.log_interval = 1000;
  f.train.lr.warmup_steps = 0;
  f.train.peak_gflops = 100;  // skip the start-up GEMM probe
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

// The multi-rank gtests' model as command-line words: two MoE layers of 8 experts and a shared
// expert, micro-batch 1 and global batch 8 (so every world size up to 8 splits it), no GEMM probe;
// each test adds its steps and what it varies.
inline std::vector<std::string> tiny_mpi_args() {
  return {"--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
          "--num-layers", "2", "--num-experts", "8", "--moe-ffn-hidden-size", "16",
          "--ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "16",
          "--vocab-size", "64", "--make-vocab-size-divisible-by", "64",
          "--micro-batch-size", "1", "--global-batch-size", "8",
          "--log-interval", "1000", "--peak-tflops", "0.1"};
}

}  // namespace moecore::cli
