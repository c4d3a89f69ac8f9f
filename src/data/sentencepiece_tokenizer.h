// The SentencePiece tokenizers (--tokenizer-model file.model, Debian's libsentencepiece), with
// the three behaviours Megatron gives the name:
//   SentencePieceTokenizer: <CLS>, <SEP>, <EOD>, <MASK> (and <PAD>, <BOS>, <EOS> where the model
//     has no pad / bos / eos piece) added after the model's pieces when it lacks them; any of
//     them in the text is that token (the leftmost, the first in that order on ties), the rest
//     is SentencePiece-encoded; eod is <EOD>;
//   GPTSentencePieceTokenizer: the model's ids as they are; eod is the model's eos;
//   Llama2Tokenizer: bos, then the model's ids; eod is the model's eos.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moecore::data {

enum class SentencePieceFlavour { Megatron, Gpt, Llama2 };

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& model_file, SentencePieceFlavour flavour);
  ~SentencePieceTokenizer() override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  void tokenize(std::string_view text, std::vector<int64_t>& out) const override;
  std::string describe() const override;

 private:
  void encode(std::string_view text, std::vector<int64_t>& out) const;
  std::string model_file_;
  SentencePieceFlavour flavour_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::vector<std::pair<std::string, int64_t>> special_;  // SentencePieceTokenizer, in order
  int64_t vocab_size_ = 0, eod_ = 0, bos_ = -1;
};

}  // namespace moecore::data
