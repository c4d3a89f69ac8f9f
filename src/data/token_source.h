// Where training tokens come from. Sample i of a source is a pure function of (source, i): the
// trainer asks for the samples of the global batch by index, so every data-parallel layout
// sees the same global batch.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

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
};

struct DataConfig {
  std::string data_path;                 // --data-path (empty: the synthetic language)
  std::string tokenizer_type = "ByteLevel";  // --tokenizer-type
  int64_t synthetic_vocab = 256;         // --vocab-size before padding (synthetic language)
  int64_t synthetic_branching = 4;       // successors per token of the synthetic language
};

// The source for `cfg` (checks the file exists and is long enough for seq_length + 1 tokens).
std::unique_ptr<TokenSource> make_token_source(const DataConfig& cfg, int64_t seq_length,
                                               uint64_t seed);

// Fills ids/targets [n_samples, S] with samples first_index, first_index + 1, ...: ids are
// tokens [0, S), targets tokens [1, S]. scratch holds S + 1 tokens.
void make_batch(const TokenSource& src, int32_t* ids_BS, int32_t* targets_BS, int64_t n_samples,
                int64_t S, uint64_t first_index, int32_t* scratch_S1);

}  // namespace moecore::data
