// GPT2BPETokenizer: GPT-2's vocab.json + merges.txt (--vocab-file, --merge-file), tokenized as
// Megatron's GPT2BPETokenizer does through HuggingFace's GPT-2 tokenizer: <|endoftext|> in the
// text is that token, the rest is pre-tokenized by GPT-2's regex and byte-level BPE encoded.
// Vocabulary: the vocab.json entries; end of document: <|endoftext|>.
#pragma once

#include <memory>
#include <string>

#include "data/added_tokens.h"
#include "data/byte_level_bpe.h"
#include "data/tokenizer.h"

namespace moecore::data {

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file);
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  void tokenize(std::string_view text, std::vector<int64_t>& out) const override;
  std::string describe() const override;

 private:
  std::unique_ptr<ByteLevelBpe> bpe_;
  AddedTokens added_;
  int64_t vocab_size_ = 0, eod_ = 0;
  std::string vocab_file_;
};

// Reads a whole text file; throws naming the flag and the path when it cannot.
std::string read_tokenizer_file(const std::string& path, const std::string& flag);

}  // namespace moecore::data
