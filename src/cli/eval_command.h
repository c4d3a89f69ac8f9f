// `moecore eval --load DIR <the model's train flags> [--tokens-json FILE]`: the mean loss of a
// checkpoint (trained, or imported by `moecore convert`). With --tokens-json FILE (a JSON list
// of token-id lists) it prints the mean next-token cross entropy over every prediction of every
// sequence and each sequence's own; without it, the mean lm loss over --eval-iters global
// batches of the validation split (--data-path ..., as `moecore train` evaluates). Either goes
// through the trainer's evaluation forward (Trainer::score_sequences, Trainer::evaluate), so it
// runs under mpirun in any layout the checkpoint loads into, on --device cpu or cuda; rank 0
// prints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/command.h"

namespace moecore::cli {

Subcommand add_eval_command(CLI::App& app);

// The token-id lists of a --tokens-json file; throws naming the file and the entry when it is
// not a JSON list of lists of non-negative integers below vocab_size.
std::vector<std::vector<int32_t>> read_tokens_json(const std::string& path, int64_t vocab_size);

}  // namespace moecore::cli
