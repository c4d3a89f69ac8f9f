// libFuzzer target for the .npy index cache (src/data/index_cache.cpp) and its reader in
// GPTDataset (--data-cache-path): one of the three cached arrays of a small dataset is replaced
// by the input, the other two stay as moecore wrote them, and the dataset is built again from
// the cache. Either it loads (or rebuilds) indices from which every sample reads seq_length + 1
// token ids of the dataset without an error, or the construction fails with moecore::Error; read_npy on the input alone either
// gives rows * max(cols, 1) values or fails with moecore::Error.
//
// Input: byte 0 % 3 picks the file (0 document_index.npy, 1 sample_index.npy, 2
// shuffle_index.npy), the rest is that file. The seeds (tests/fuzz/corpus/index_cache/) are the
// three files as written, each behind its byte.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/gpt_dataset.h"
#include "data/index_cache.h"
#include "fuzz_common.h"

namespace {

using namespace moecore::data;

constexpr int64_t kSeqLength = 8, kVocab = 50, kSamples = 24;

// Ten documents of 1..19 tokens, token t of sequence s = (s + t) % kVocab.
class SmallDataset final : public LowLevelDataset {
 public:
  SmallDataset() {
    for (int s = 0; s < 10; ++s) lengths_.push_back(1 + (7 * s) % 19);
  }
  const std::string& name() const override { return name_; }
  int64_t num_sequences() const override { return static_cast<int64_t>(lengths_.size()); }
  int32_t sequence_length(int64_t i) const override { return lengths_.at(i); }
  std::vector<int32_t> sequence_lengths() const override { return lengths_; }
  int64_t num_tokens() const override {
    int64_t n = 0;
    for (int32_t l : lengths_) n += l;
    return n;
  }
  void get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const override {
    MOE_CHECK(seq >= 0 && seq < num_sequences() && offset >= 0 && length >= 0 &&
                  offset + length <= lengths_[seq],
              "[fuzz] tokens [{}, {}) of sequence {}", offset, offset + length, seq);
    for (int64_t t = 0; t < length; ++t) out[t] = static_cast<int32_t>((seq + offset + t) % kVocab);
  }

 private:
  std::string name_ = "fuzz-small";
  std::vector<int32_t> lengths_;
};

GPTDatasetConfig config() {
  GPTDatasetConfig c;
  c.seq_length = kSeqLength;
  c.split = "1";
  c.cache_path = (moecore::fuzz::scratch_dir() / "cache").string();
  c.vocab = kVocab;
  return c;
}

struct Cache {
  std::shared_ptr<const LowLevelDataset> data = std::make_shared<SmallDataset>();
  std::vector<std::string> paths;  // document, sample, shuffle
  std::vector<std::string> bytes;  // as moecore wrote them
};

const Cache& cache() {
  static const Cache c = [] {
    Cache out;
    const GPTDataset ds(out.data, Split::Train, kSamples, config());  // writes the cache
    const IndexCache ic(config().cache_path, config().class_name, "train", ds.description());
    for (const char* name : {"document_index.npy", "sample_index.npy", "shuffle_index.npy"}) {
      out.paths.push_back(ic.path_of(name));
      std::FILE* f = std::fopen(out.paths.back().c_str(), "rb");
      std::string b;
      for (int ch; f != nullptr && (ch = std::fgetc(f)) != EOF;) b.push_back(static_cast<char>(ch));
      if (f != nullptr) std::fclose(f);
      out.bytes.push_back(b);
    }
    return out;
  }();
  return c;
}

template <typename T>
void read_alone(const std::string& path) {
  try {
    int64_t rows = -1, cols = -1;
    const auto v = read_npy<T>(path, &rows, &cols);
    FUZZ_EXPECT(v.has_value() && rows >= 0 && cols >= 0);
    FUZZ_EXPECT(static_cast<int64_t>(v->size()) == rows * (cols > 0 ? cols : 1));
  } catch (const moecore::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Cache& c = cache();
  const size_t which = data[0] % 3;
  for (size_t i = 0; i < 3; ++i) {
    if (i == which) {
      moecore::fuzz::write_path(c.paths[i], data + 1, size - 1);
    } else {
      moecore::fuzz::write_path(c.paths[i], c.bytes[i].data(), c.bytes[i].size());
    }
  }
  read_alone<int16_t>(c.paths[which]);
  read_alone<int32_t>(c.paths[which]);
  read_alone<int64_t>(c.paths[which]);
  std::unique_ptr<GPTDataset> ds;
  try {
    ds = std::make_unique<GPTDataset>(c.data, Split::Train, kSamples, config());
  } catch (const moecore::Error&) {
    return 0;
  }
  // Built: every sample reads, no exception (the cached indices were checked when loaded).
  FUZZ_EXPECT(ds->num_samples() >= kSamples);
  std::vector<int32_t> tokens(kSeqLength + 1);
  for (int64_t i = 0; i < ds->num_samples(); ++i) {
    tokens.assign(tokens.size(), -1);
    ds->sample(tokens.data(), kSeqLength + 1, static_cast<uint64_t>(i));
    for (int32_t t : tokens) FUZZ_EXPECT(t >= 0 && t < kVocab);
  }
  return 0;
}
