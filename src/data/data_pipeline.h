// From --data-path (and --split, --data-cache-path, --mock-data, the tokenizer) to the train,
// validation and test sources, as Megatron's BlendedMegatronDatasetBuilder builds them:
//   one prefix                  -> a GPTDataset per split with the requested samples;
//   weight prefix weight prefix -> per prefix a GPTDataset per split of ceil(ceil(n * w) * 1.005)
//                                  samples, blended to sum(ceil(n * w)) samples;
//   prefix prefix ...           -> per prefix one epoch per split, blended exhaustively by their
//                                  sizes (capped at the requested samples).
// A --data-path entry that names a plain text file (no .idx beside it) is moecore's byte-level
// text source (training split only).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/data_split.h"
#include "data/token_source.h"

namespace moecore::data {

struct BlendEntry {
  std::string prefix;
  double weight = 0;  // unnormalised; 0 when the list has no weights
};

// Megatron's get_blend_from_list: an even list whose every other item parses as a number is
// weight/prefix pairs, anything else a list of prefixes.
std::vector<BlendEntry> parse_blend(const std::vector<std::string>& items, bool* has_weights);

// What a --data-path entry names: a prefix of a .idx/.bin pair, or a plain text file. Anything
// that cannot serve (missing, a directory, a special or unreadable file, a .idx without its
// .bin, a path given with its extension) is an error naming the path.
enum class DataPathKind { IndexedPrefix, TextFile };
DataPathKind classify_data_path(const std::string& path);

struct DataSplits {
  std::array<std::unique_ptr<TokenSource>, kNumSplits> split;  // null: the split has no data
  std::vector<std::string> notes;  // one line per split left empty, and the like
  TokenSource* train() const { return split[0].get(); }
  TokenSource* valid() const { return split[1].get(); }
  TokenSource* test() const { return split[2].get(); }
};

// num_samples: Megatron's train_valid_test_num_samples. vocab, eod: the tokenizer's vocabulary
// (token ids are checked against it) and end-of-document id (the mock data ends sequences
// with it; only mock data needs one, so callers ask the tokenizer for it only then: a
// tokenizer.json without an eos_token trains on files).
DataSplits build_data_splits(const DataConfig& cfg, int64_t seq_length, uint32_t seed,
                             const std::array<int64_t, kNumSplits>& num_samples, int64_t vocab,
                             int64_t eod);

// Megatron's legacy default when --data-path is given without --split.
inline constexpr const char* kDefaultSplit = "969, 30, 1";

}  // namespace moecore::data
