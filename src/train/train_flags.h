// Megatron-LM flag names for `moecore train`, bound to the config structs. Defaults describe
// the built-in tiny MoE model on the synthetic language (the README's run command).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "model/config.h"
#include "train/router_flags.h"
#include "train/trainer.h"

namespace moecore::train {

struct TrainFlags {
  ModelConfig model;
  TrainConfig train;
  // Strings resolved after parsing.
  RouterFlags router;
  std::string moe_layer_freq = "1";
  std::string lr_decay_style = "cosine";
  bool group_query_attention = false;
};

TrainFlags default_train_flags();
void add_train_flags(CLI::App& app, TrainFlags& f);
// Resolves the string flags and derived values; validates everything before any allocation.
void finalize_train_flags(TrainFlags& f);

}  // namespace moecore::train
