// Megatron-LM flag names for `moecore train`, bound to the config structs, with Megatron's
// defaults (src/cli/megatron_arguments.json; a test compares them). Megatron's required
// flags (--num-layers, --hidden-size, ...) are required here too; configs/tiny.toml states the
// tiny default model. parse_train_args is the whole command line: argparse semantics
// (megatron_argv.h), every Megatron flag classified (megatron_compat.h), then the bound values
// resolved and validated with Megatron's rules before anything is allocated.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "model/config.h"
#include "parallel/parallel_config.h"
#include "cli/checkpoint_flags.h"
#include "cli/megatron_compat.h"
#include "cli/router_flags.h"
#include "train/trainer.h"

namespace CLI {
class App;  // <CLI/CLI.hpp> (heavy) in the .cpp files that build parsers
}  // namespace CLI

namespace moecore::cli {

using train::TrainConfig;

// Megatron's None for a float flag.
inline bool is_none(double v) { return std::isnan(v); }

struct TrainFlags {
  TrainFlags();  // Megatron's defaults
  ModelConfig model;
  TrainConfig train;
  parallel::ParallelConfig parallel;        // --tensor-model-parallel-size, ...
  // Values resolved after parsing.
  RouterFlags router;
  CheckpointFlags ckpt;
  int64_t vocab_size = 0;                   // --vocab-size (before padding); 0: None
  int64_t make_vocab_size_divisible_by = 128;
  bool untie_embeddings = false;
  bool group_query_attention = false;
  bool swiglu = false;                      // without it, Megatron's GeLU MLP
  bool openai_gelu = false;                 // the tanh form of GeLU (GPT-2's)
  bool squared_relu = false;
  bool disable_bias_linear = false;         // without it, biases on every linear layer
  std::string normalization = "LayerNorm";  // LayerNorm | RMSNorm
  bool apply_layernorm_1p = false;
  std::string position_embedding_type = "learned_absolute";  // learned_absolute | rope | none
  // Multi-latent attention's rotary: --rope-type ("" is Megatron's None: yarn for MLA) and
  // Megatron's --yarn-* flags (None: MLATransformerConfig's 4096, 32, 1).
  std::string rope_type;
  int64_t yarn_original_max_position_embeddings = 0;
  double yarn_beta_fast = NAN;
  double yarn_beta_slow = NAN;
  // --fp32, moecore's own: fp32 training spelled out (the default; Megatron has no such flag).
  // Given with --bf16 it is refused: the two name different precisions.
  bool fp32 = false;
  bool check_for_nan = false;               // --check-for-nan-in-loss-and-grad (the default)
  bool no_check_for_nan = false;            // --no-check-for-nan-in-loss-and-grad
  bool bf16 = false;
  std::string moe_layer_freq = "1";
  bool moe_layer_recompute = false;         // deprecated: selective + the "moe" module
  bool recompute_activations = false;       // --recompute-activations: selective
  bool checkpoint_activations = false;      // deprecated: an error, as in Megatron
  int64_t batch_size = 0;                   // --batch-size (deprecated: an error)
  int64_t model_parallel_size = 0;          // --model-parallel-size (deprecated: an error)
  std::string recompute_granularity;        // "" (None), full, selective
  std::string recompute_method;             // "" (None), uniform, block
  std::string lr_decay_style = "linear";
  std::string lr_wsd_decay_style = "exponential";
  double lr_warmup_fraction = NAN;          // None
  double peak_tflops = 0;
  // Megatron's CUDA graph flags before validate_args' migration (finalize_train_flags):
  // --cuda-graph-modules, the deprecated --cuda-graph-scope (its old name), --enable-cuda-graph
  // (deprecated: "local") and --external-cuda-graph (deprecated: "transformer_engine").
  std::vector<std::string> cuda_graph_modules;
  std::vector<std::string> cuda_graph_scope;
  bool enable_cuda_graph = false;
  bool external_cuda_graph = false;
  std::string config_file;                  // consumed before parsing (expand_config_files)
  std::vector<std::string> notices;         // one line per flag accepted without effect
};

void add_train_flags(CLI::App& app, TrainFlags& f);
// Resolves the string flags and derived values (Megatron's rules: --ffn-hidden-size from
// --hidden-size, --moe-ffn-hidden-size from --ffn-hidden-size, ...); validates everything.
void finalize_train_flags(TrainFlags& f);

// The `moecore train` command line (without the subcommand; --config FILE expanded here):
// throws moecore::Error with the flag, the values and the fix.
TrainFlags parse_train_args(const std::vector<std::string>& args);
// Values for the flags training requires (--micro-batch-size, --train-iters, --lr) for uses that
// run no step (eval, the converters): put before the given flags, which then win.
const std::vector<std::string>& no_step_placeholder_args();
// `moecore train --help`: the bound flags grouped as arguments.py groups them.
std::string train_help();
// Whether add_train_flags binds `f` (by any of its names).
bool train_binds(const MegatronFlag& f);
// The generated section of docs/flags.md.
std::string train_flags_markdown();

// What the parallel layout is validated against (parallel::validate_layout).
parallel::ModelDims model_dims(const ModelConfig& m);

// Megatron's vocabulary padding: the smallest multiple of `divisible_by` >= vocab.
int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by);

}  // namespace moecore::cli
