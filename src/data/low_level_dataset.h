// What a GPTDataset samples from: numbered sequences of token ids (Megatron's LowLevelDataset:
// an IndexedDataset, or the mock dataset of --mock-data).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore::data {

class LowLevelDataset {
 public:
  virtual ~LowLevelDataset() = default;
  virtual const std::string& name() const = 0;  // the prefix, for messages and cache keys
  virtual int64_t num_sequences() const = 0;
  virtual int32_t sequence_length(int64_t i) const = 0;
  virtual std::vector<int32_t> sequence_lengths() const = 0;
  virtual int64_t num_tokens() const = 0;
  // Writes tokens [offset, offset + length) of sequence `seq` as int32.
  virtual void get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const = 0;
};

}  // namespace moecore::data
