// Megatron-LM's checkpointing and exit flags bound to CheckpointConfig, with Megatron's names
// and defaults: --save, --load, --save-interval, --async-save, --finetune, --no-save-optim,
// --no-load-optim,
// --no-save-rng, --no-load-rng, --ckpt-step, --exit-on-missing-checkpoint, --exit-interval,
// --exit-duration-in-mins, --exit-signal-handler.
#pragma once


#include "train/checkpoint_config.h"

namespace CLI {
class App;  // <CLI/CLI.hpp> (heavy) in the .cpp files that build parsers
}  // namespace CLI

namespace moecore::cli {

using train::CheckpointConfig;

// The store_true flags Megatron names negatively, as given.
struct CheckpointFlags {
  bool no_save_optim = false;
  bool no_load_optim = false;
  bool no_save_rng = false;
  bool no_load_rng = false;
};

void add_checkpoint_flags(CLI::App& app, CheckpointConfig& c, CheckpointFlags& f);
// After parsing: the negative flags into `c`, then c.validate().
void finalize_checkpoint_flags(CheckpointConfig& c, const CheckpointFlags& f);

}  // namespace moecore::cli
