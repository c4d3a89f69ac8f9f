// Where training tokens come from. Sample i of a source is a pure function of (source, i): the
// trainer asks for the samples of the global batch by index, so every data-parallel layout
// sees the same global batch.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace moecore::data {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Tokens ids in [0, vocab()).
  virtual int64_t vocab() const = 0;
  // Best achievable next-token loss in nats, or NaN when unknown (real text).
  virtual double entropy_floor() const { return std::numeric_limits<double>::quiet_NaN(); }
  // Writes len tokens of sample `index` (len = seq_length + 1: inputs and shifted targets).
  virtual void sample(int32_t* tokens, int64_t len, uint64_t index) const = 0;
  virtual std::string describe() const = 0;
  // Distinct samples the source holds (sample indices run below it), or -1: unbounded.
  virtual int64_t num_samples() const { return -1; }
};

struct DataConfig {
  // --data-path: one prefix of a .bin/.idx pair, weight/prefix pairs, or several prefixes
  // (data_pipeline.h); a single plain text file is read byte-level. Empty (and no --mock-data):
  // the synthetic language.
  std::vector<std::string> data_path;
  std::string split;            // --split ("": Megatron's legacy default "969, 30, 1")
  std::string data_cache_path;  // --data-cache-path ("": indices are rebuilt every run)
  bool mock_data = false;       // --mock-data
  // --eod-mask-loss: no loss where the input token is the tokenizer's EOD (Megatron's
  // loss_mask[tokens == eod] = 0: the prediction made at a document's end).
  bool eod_mask_loss = false;
  TokenizerConfig tokenizer;    // --tokenizer-type, --vocab-size, --vocab-file, ...
  int64_t synthetic_vocab = 256;         // --vocab-size before padding (synthetic language)
  int64_t synthetic_branching = 4;       // successors per token of the synthetic language
  bool synthetic() const { return data_path.empty() && !mock_data; }
};

// Fills ids/targets [n_samples, S] with samples first_index, first_index + 1, ...: ids are
// tokens [0, S), targets tokens [1, S]. scratch holds S + 1 tokens.
void make_batch(const TokenSource& src, int32_t* ids_BS, int32_t* targets_BS, int64_t n_samples,
                int64_t S, uint64_t first_index, int32_t* scratch_S1);

}  // namespace moecore::data
