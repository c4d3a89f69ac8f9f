// `moecore preprocess`: text in, Megatron indexed datasets out, byte for byte what
// tools/preprocess_data.py writes for the same tokens: one document per input line (JSON lines:
// the text under each --json-keys key, a string or a list of strings; plain text: the line),
// empty documents kept as documents of no sequence, --append-eod adding the tokenizer's eod to
// each non-empty document, the dtype chosen from the vocabulary size (uint16 under 65500,
// else int32), outputs <prefix>_<key>_document.{bin,idx}. Lines are tokenized in parallel
// blocks and written in input order.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace moecore::data {

struct PreprocessConfig {
  std::string input;                         // --input
  std::string input_format = "auto";         // --input-format: auto (by extension) | jsonl | text
  std::vector<std::string> json_keys = {"text"};  // --json-keys
  std::string output_prefix;                 // --output-prefix
  bool append_eod = false;                   // --append-eod
  int workers = 0;                           // --workers (0: all hardware threads)
  int64_t log_interval = 1000;               // --log-interval (documents)
  TokenizerConfig tokenizer;
};

struct PreprocessStats {
  int64_t documents = 0;
  int64_t input_bytes = 0;
  std::vector<int64_t> tokens;  // per key
  double seconds = 0;
  std::vector<std::string> outputs;  // the prefixes written, one per key
};

// The output prefix for a key, as preprocess_data.py names it.
std::string preprocess_output_prefix(const std::string& prefix, const std::string& key);
PreprocessStats preprocess(const PreprocessConfig& cfg, std::ostream& log);

}  // namespace moecore::data
