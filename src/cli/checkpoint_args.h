// Megatron-LM's --use-checkpoint-args: the model's flags from the checkpoint being loaded. Every
// checkpoint records the flags of the run that wrote it (the manifest's state "args", the
// command line with its config files expanded); with --use-checkpoint-args the model's flags
// among them fill what the command line leaves unset, as Megatron's load_args_from_checkpoint
// does: a flag given on the command line wins (a different model is then refused at load, naming
// the flag). So `moecore eval --load DIR --use-checkpoint-args --tokens-json F` and a resume
// need no model flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli/megatron_argv.h"

namespace moecore::cli {

// Whether a flag shapes the model or what it computes (its structure, routing, vocabulary,
// losses), and so comes from the checkpoint under --use-checkpoint-args. Layout, precision,
// schedule, data and logging flags do not.
bool is_model_flag(const GivenFlag& g);

// The model flags the run that wrote `load`'s checkpoint (its tracker's iteration, or
// `ckpt_step` when >= 0) was given, as arguments. Throws naming the directory when there is no
// checkpoint or it records no flags.
std::vector<std::string> checkpoint_model_args(const std::string& load, int64_t ckpt_step,
                                               const std::vector<OwnFlag>& own);

}  // namespace moecore::cli
