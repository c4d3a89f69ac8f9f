// The SentencePiece tokenizers (--tokenizer-model file.model, Debian's libsentencepiece).
// Megatron-LM at the commit of moecore's flag table (d98e8a6) builds SentencePieceTokenizer,
// GPTSentencePieceTokenizer and Llama2Tokenizer alike (megatron/core/tokenizers, not legacy):
// the model's ids as they are (no bos added), vocabulary the model's pieces, eod the model's
// eos. (The legacy wrappers before it added <CLS>/<SEP>/<EOD>/<MASK> tokens, or a bos for
// Llama2Tokenizer; --tokenizer-sentencepiece-legacy stays refused.)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moecore::data {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // type: the --tokenizer-type it was built for, for messages.
  SentencePieceTokenizer(const std::string& model_file, const std::string& type);
  ~SentencePieceTokenizer() override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override;
  void tokenize(std::string_view text, std::vector<int64_t>& out) const override;
  std::string describe() const override;

 private:
  std::string model_file_, type_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  int64_t vocab_size_ = 0, eos_ = -1;
};

}  // namespace moecore::data
