// `moecore dataset-info --data-path ... --seq-length S [--split ...] [--seed N]
// --train-samples M [--dump-samples K] [--json]`: what training would read, without training:
// per dataset its sequences, documents and token statistics; per split the documents it takes,
// its epochs and samples (and blend weights); with --dump-samples the token ids of the first K
// training samples in order (JSON: a list of lists of seq_length + 1 ids).
#pragma once

#include "core/command.h"

namespace moecore::data {

Subcommand add_dataset_info_command(CLI::App& app);

}  // namespace moecore::data
