// `moecore train`: parses Megatron-LM flags into the configs, validates them, trains.
#pragma once

#include "core/command.h"

namespace moecore::cli {

Subcommand add_train_command(CLI::App& app);

}  // namespace moecore::cli
