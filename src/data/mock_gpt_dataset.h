// Megatron's --mock-data: MockGPTLowLevelDataset, 100,000 sequences whose lengths are
// numpy.random.default_rng(0).integers(1, 4096) and whose tokens are 1, 2, ..., length - 1
// (mod the vocabulary) then the end-of-document id. GPTDataset samples it like real data (split
// "1,1,1", never cached), so a mock run sees Megatron's mock token stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/low_level_dataset.h"

namespace moecore::data {

class MockGPTLowLevelDataset final : public LowLevelDataset {
 public:
  static constexpr int64_t kSize = 100000;
  static constexpr int32_t kMaxSequenceLength = 4096;
  MockGPTLowLevelDataset(int64_t vocab, int64_t eod);

  const std::string& name() const override { return name_; }
  int64_t num_sequences() const override { return kSize; }
  int32_t sequence_length(int64_t i) const override { return lengths_[i]; }
  std::vector<int32_t> sequence_lengths() const override { return lengths_; }
  int64_t num_tokens() const override;
  void get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const override;

 private:
  std::string name_ = "mock";
  int64_t vocab_, eod_;
  std::vector<int32_t> lengths_;
};

}  // namespace moecore::data
