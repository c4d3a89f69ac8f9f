#include "data/mock_gpt_dataset.h"

#include "core/check.h"
#include "data/numpy_random.h"

namespace moecore::data {

MockGPTLowLevelDataset::MockGPTLowLevelDataset(int64_t vocab, int64_t eod)
    : vocab_(vocab), eod_(eod), lengths_(kSize) {
  MOE_CHECK(vocab >= 2 && eod >= 0 && eod < vocab, "[data] --mock-data with vocab {} and eod {}",
            vocab, eod);
  NumpyGenerator rng(0);  // Megatron's hard-coded seed
  for (int32_t& l : lengths_) l = rng.integers_int32(1, kMaxSequenceLength);
}

int64_t MockGPTLowLevelDataset::num_tokens() const {
  int64_t n = 0;
  for (int32_t l : lengths_) n += l;
  return n;
}

void MockGPTLowLevelDataset::get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const {
  const int64_t len = lengths_[seq];
  MOE_CHECK(offset >= 0 && length >= 0 && offset + length <= len,
            "[data] mock sequence {} of length {}: tokens [{}, {})", seq, len, offset,
            offset + length);
  for (int64_t t = 0; t < length; ++t) {
    const int64_t p = offset + t;
    out[t] = static_cast<int32_t>(p == len - 1 ? eod_ : (p + 1) % vocab_);
  }
}

}  // namespace moecore::data
