// Megatron-LM's data, tokenizer and evaluation flags (--data-path, --split, --data-cache-path,
// --mock-data, --tokenizer-type, --vocab-file, --merge-file, --tokenizer-model, --eval-interval,
// --eval-iters) bound to DataConfig and TrainConfig, with Megatron's names and defaults.
#pragma once


#include "data/token_source.h"
#include "train/trainer.h"

namespace CLI {
class App;  // <CLI/CLI.hpp> (heavy) in the .cpp files that build parsers
}  // namespace CLI

namespace moecore::cli {

using train::TrainConfig;

// Without data files and without --vocab-size, the synthetic language speaks in bytes.
constexpr int64_t kSyntheticDefaultVocab = 256;

void add_data_flags(CLI::App& app, TrainConfig& t);
// After parsing: checks the data flags go together and returns the vocabulary the model needs
// before padding: the tokenizer's for real or mock data, --vocab-size for the synthetic
// language (vocab_size_flag: the --vocab-size value, 256 when not given).
int64_t finalize_data_flags(TrainConfig& t, int64_t vocab_size_flag);

}  // namespace moecore::cli
