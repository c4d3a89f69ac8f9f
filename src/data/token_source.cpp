#include "data/token_source.h"

#include "core/check.h"
#include "data/byte_text_dataset.h"
#include "data/synthetic_language.h"

namespace moecore::data {

std::unique_ptr<TokenSource> make_token_source(const DataConfig& cfg, int64_t seq_length,
                                               uint64_t seed) {
  if (cfg.data_path.empty()) {
    return std::make_unique<SyntheticLanguage>(cfg.synthetic_vocab, cfg.synthetic_branching, seed);
  }
  MOE_CHECK(cfg.tokenizer_type == "ByteLevel",
            "[data] --tokenizer-type {} is not supported for text files: use ByteLevel",
            cfg.tokenizer_type);
  return std::make_unique<ByteTextDataset>(cfg.data_path, seq_length, seed);
}

void make_batch(const TokenSource& src, int32_t* ids_BS, int32_t* targets_BS, int64_t n_samples,
                int64_t S, uint64_t first_index, int32_t* scratch_S1) {
  for (int64_t b = 0; b < n_samples; ++b) {
    src.sample(scratch_S1, S + 1, first_index + b);
    for (int64_t s = 0; s < S; ++s) {
      ids_BS[b * S + s] = scratch_S1[s];
      targets_BS[b * S + s] = scratch_S1[s + 1];
    }
  }
}

}  // namespace moecore::data
