// Megatron-LM flag names for `moecore train`, bound to the config structs. Defaults describe
// the built-in tiny MoE model on the synthetic language; where Megatron's own default differs
// (tied embeddings, no --swiglu, ...) docs/flags.md says so.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "parallel/parallel_config.h"
#include "train/megatron_compat.h"
#include "train/router_flags.h"
#include "train/trainer.h"

namespace moecore::train {

struct TrainFlags {
  ModelConfig model;
  TrainConfig train;
  parallel::ParallelConfig parallel;        // --tensor-model-parallel-size, ... (Distributed)
  // Values resolved after parsing.
  RouterFlags router;
  int64_t vocab_size = 256;                 // --vocab-size (before padding)
  int64_t make_vocab_size_divisible_by = 128;
  bool untie_embeddings = false;
  bool group_query_attention = false;
  bool swiglu = true;                       // SwiGLU is the only MLP: the flag is accepted
  bool disable_bias_linear = true;          // no linear biases (except --add-qkv-bias)
  bool fp32 = true;
  bool bf16 = false;
  std::string moe_layer_freq = "1";
  bool recompute_activations = false;       // --recompute-activations: selective
  std::string recompute_granularity;        // "", full, selective
  std::string recompute_method;             // "", uniform, block
  std::string lr_decay_style = "cosine";
  std::string lr_wsd_decay_style = "exponential";
  double lr_warmup_fraction = 0;
  const CLI::Option* lr_warmup_iters_opt = nullptr;  // given explicitly? (vs the fraction)
  double peak_tflops = 0;
  std::string config_file;                  // consumed before parsing (expand_config_files)
  MegatronCompat compat;
  std::vector<std::string> notices;         // one line per accepted-and-ignored flag
};

TrainFlags default_train_flags();
void add_train_flags(CLI::App& app, TrainFlags& f);
// Resolves the string flags and derived values; validates everything before any allocation.
void finalize_train_flags(TrainFlags& f);

// What the parallel layout is validated against (parallel::validate_layout).
parallel::ModelDims model_dims(const ModelConfig& m);

// Megatron's vocabulary padding: the smallest multiple of `divisible_by` >= vocab.
int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by);

}  // namespace moecore::train
