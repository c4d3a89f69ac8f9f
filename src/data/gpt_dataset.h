// Megatron's GPTDataset over an indexed dataset: the documents of one split (a range of the
// indexed dataset's sequences), repeated for as many epochs as the requested samples need, in
// an order shuffled per epoch (document index); samples of seq_length + 1 tokens cut from that
// stream at stride seq_length, crossing document boundaries (sample index); and the samples
// visited in a shuffled order (shuffle index). A final epoch that would contribute under 80% of
// an epoch's samples is shuffled separately, so its samples come last. Every step is Megatron's
// (gpt_dataset.py, helpers.cpp build_sample_idx) with numpy's RandomState(seed), so the sample
// stream is Megatron's token for token.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "data/data_split.h"
#include "data/low_level_dataset.h"
#include "data/token_source.h"

namespace moecore::data {

struct GPTIndices {
  int64_t tokens_per_epoch = 0;
  int64_t num_epochs = 0;
  bool separate_final_epoch = false;
  std::vector<int32_t> document_index;  // [num_epochs * documents]: a sequence id per entry
  std::vector<int64_t> sample_index;    // [(num_samples + 1) * 2]: (document_index position, offset)
  std::vector<int64_t> shuffle_index;   // [num_samples]
  int64_t num_samples() const { return static_cast<int64_t>(shuffle_index.size()); }
};

// Megatron's _get_num_epochs: epochs whose tokens cover num_samples * seq_length + 1
// (num_samples < 0: one epoch).
int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t num_samples, int64_t seq_length);

// Throws, naming the samples, epochs and bytes, unless the three indices of num_epochs epochs of
// num_docs documents fit in this machine's memory (host_memory.h).
void check_index_bytes(int64_t num_docs, int64_t tokens_per_epoch, int64_t num_epochs,
                       int64_t num_samples, int64_t seq_length);

// Builds the three indices for the documents [doc_begin, doc_end) of `sequence_lengths`.
// num_samples < 0: as many samples as one epoch gives (Megatron's num_samples=None).
GPTIndices build_gpt_indices(std::span<const int32_t> sequence_lengths, int64_t doc_begin,
                             int64_t doc_end, int64_t num_samples, int64_t seq_length,
                             uint32_t seed);

// helpers.cpp build_sample_idx (drop_last_partial_sequence, add_extra_token_to_sequence = 1).
std::vector<int64_t> build_sample_index(std::span<const int32_t> sequence_lengths,
                                        std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t num_epochs,
                                        int64_t tokens_per_epoch);

struct GPTDatasetConfig {
  int64_t seq_length = 0;
  uint32_t seed = 1234;
  std::string split = "969, 30, 1";
  std::string cache_path;  // --data-cache-path: where the indices are saved and found ("" none)
  std::string class_name = "GPTDataset";  // "MockGPTDataset" for --mock-data (in cache keys)
  int64_t vocab = 0;       // token ids must be below this
};

class GPTDataset final : public TokenSource {
 public:
  // num_samples < 0: one epoch. Throws, naming the sizes and the fix, when the split holds
  // fewer than seq_length + 1 tokens and samples are asked of it (always of the training split).
  GPTDataset(std::shared_ptr<const LowLevelDataset> data, Split split, int64_t num_samples,
             const GPTDatasetConfig& cfg);

  int64_t vocab() const override { return cfg_.vocab; }
  void sample(int32_t* tokens, int64_t len, uint64_t index) const override;
  std::string describe() const override;
  int64_t num_samples() const override { return indices_.num_samples(); }

  const GPTIndices& indices() const { return indices_; }
  Split split() const { return split_; }
  int64_t doc_begin() const { return doc_begin_; }
  int64_t doc_end() const { return doc_end_; }
  bool loaded_from_cache() const { return from_cache_; }
  // What identifies these indices (the cache key; Megatron's unique description in spirit).
  const std::string& description() const { return description_; }

 private:
  void check_split_serves_a_sample(int64_t num_samples) const;

  std::shared_ptr<const LowLevelDataset> data_;
  Split split_;
  GPTDatasetConfig cfg_;
  int64_t doc_begin_ = 0, doc_end_ = 0;
  GPTIndices indices_;
  std::string description_;
  bool from_cache_ = false;
};

}  // namespace moecore::data
