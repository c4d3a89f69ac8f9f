// Tokenizers by Megatron's --tokenizer-type names. Each maps text to token ids exactly as the
// library Megatron wraps does (tests/data compares them with fixtures made by the real
// libraries: tools/make_tokenizer_fixtures.py), and says its vocabulary size and end-of-document
// id, which fix the .bin dtype (`moecore preprocess`) and the model's vocabulary.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moecore::data {

struct TokenizerConfig {
  std::string type = "ByteLevel";  // --tokenizer-type
  int64_t vocab_size = 0;          // --vocab-size (NullTokenizer)
  std::string vocab_file;          // --vocab-file (GPT2BPETokenizer)
  std::string merge_file;          // --merge-file (GPT2BPETokenizer)
  std::string tokenizer_model;     // --tokenizer-model (HuggingFaceTokenizer, SentencePieceTokenizer)
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t eod() const = 0;
  virtual void tokenize(std::string_view text, std::vector<int64_t>& out) const = 0;
  virtual std::string describe() const = 0;
  std::vector<int64_t> tokenize(std::string_view text) const {
    std::vector<int64_t> v;
    tokenize(text, v);
    return v;
  }
};

// The tokenizer types this build implements, comma-separated, for messages and --help.
const char* tokenizer_types();
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerConfig& cfg);

// ByteLevel: the UTF-8 bytes of the text (Megatron's ByteLevelTokenizer ids), vocabulary 256,
// end of document 0 (its eos id).
class ByteLevelTokenizer final : public Tokenizer {
 public:
  int64_t vocab_size() const override { return 256; }
  int64_t eod() const override { return 0; }
  void tokenize(std::string_view text, std::vector<int64_t>& out) const override;
  std::string describe() const override { return "ByteLevel (UTF-8 bytes, vocab 256, eod 0)"; }
};

// NullTokenizer: the text is the ids, separated by single spaces (Python's
// [int(x) for x in text.split(' ')]); vocabulary --vocab-size, end of document vocab_size - 1.
class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_size);
  int64_t vocab_size() const override { return vocab_; }
  int64_t eod() const override { return vocab_ - 1; }
  void tokenize(std::string_view text, std::vector<int64_t>& out) const override;
  std::string describe() const override;

 private:
  int64_t vocab_;
};

}  // namespace moecore::data
