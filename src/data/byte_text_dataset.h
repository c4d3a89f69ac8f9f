// A plain text file read as bytes (tokenizer ByteLevel: token = byte, vocab 256). Samples are
// windows of seq_length + 1 bytes at stride seq_length, visited in an order shuffled per epoch
// by the counter-based RNG (a pure function of seed, epoch and index).
#pragma once

#include <string>
#include <vector>

#include "data/token_source.h"

namespace moecore::data {

class ByteTextDataset final : public TokenSource {
 public:
  ByteTextDataset(const std::string& path, int64_t seq_length, uint64_t seed);

  int64_t vocab() const override { return 256; }
  void sample(int32_t* tokens, int64_t len, uint64_t index) const override;
  std::string describe() const override;
  int64_t num_windows() const { return n_windows_; }

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
  int64_t S_;
  int64_t n_windows_;
  uint64_t key_;
};

}  // namespace moecore::data
