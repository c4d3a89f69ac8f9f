// `moecore preprocess`: tools/preprocess_data.py's flags (data/preprocess.h).
#pragma once

#include "core/command.h"

namespace moecore::data {

Subcommand add_preprocess_command(CLI::App& app);

}  // namespace moecore::data
