// HuggingFaceTokenizer: a tokenizer.json (--tokenizer-model: the file or its directory) of a
// byte-level BPE model, the GPT-2 / Llama-3 / Qwen2 kind, tokenized as transformers'
// AutoTokenizer(...)(text).input_ids does (what Megatron's HuggingFaceTokenizer calls): added
// tokens split out first, the NFC normalizer if any (Qwen2's), the pre-tokenizer's regex
// (ByteLevel's own, or a Split with one of the patterns in pretokenizer.h), byte-level BPE
// (ignore_merges honoured), then the post-processor's special tokens (TemplateProcessing, e.g.
// Llama-3's bos). Anything else in the file (another model type, another normalizer, another
// pre-tokenizer) is refused by name. Vocabulary: the model's tokens and the added ones
// (len(tokenizer)); end of document: tokenizer_config.json's eos_token beside tokenizer.json.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "data/added_tokens.h"
#include "data/byte_level_bpe.h"
#include "data/pretokenizer.h"
#include "data/tokenizer.h"

namespace moecore::data {

class HuggingFaceTokenizer final : public Tokenizer {
 public:
  explicit HuggingFaceTokenizer(const std::string& tokenizer_model);
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override;
  void tokenize(std::string_view text, std::vector<int64_t>& out) const override;
  std::string describe() const override;

 private:
  std::string path_;
  std::unique_ptr<ByteLevelBpe> bpe_;
  AddedTokens added_;
  PreTokenizerPattern pattern_ = PreTokenizerPattern::Gpt2;
  bool add_prefix_space_ = false;
  bool nfc_ = false;  // the NFC normalizer, on the text between added tokens
  std::vector<int64_t> prefix_ids_, suffix_ids_;  // the post-processor's, around the text's ids
  int64_t vocab_size_ = 0, eod_ = -1;
  std::string eod_why_;  // why there is no eod, when eod_ < 0
};

}  // namespace moecore::data
