#include "data/tokenizer.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>

#include "core/check.h"
#include "data/gpt2_bpe_tokenizer.h"
#include "data/hf_tokenizer.h"
#include "data/sentencepiece_tokenizer.h"

namespace moecore::data {

void ByteLevelTokenizer::tokenize(std::string_view text, std::vector<int64_t>& out) const {
  for (unsigned char c : text) out.push_back(c);
}

NullTokenizer::NullTokenizer(int64_t vocab_size) : vocab_(vocab_size) {
  MOE_CHECK(vocab_size >= 2, "[tokenizer] NullTokenizer needs --vocab-size >= 2, not {}",
            vocab_size);
}

void NullTokenizer::tokenize(std::string_view text, std::vector<int64_t>& out) const {
  // Python's int() accepts surrounding whitespace, a sign and underscores between digits; the
  // ids a NullTokenizer text holds are plain decimal numbers, so anything else is an error.
  size_t start = 0;
  while (true) {
    const size_t end = std::min(text.find(' ', start), text.size());
    std::string_view field = text.substr(start, end - start);
    while (!field.empty() && std::isspace(static_cast<unsigned char>(field.front()))) field.remove_prefix(1);
    while (!field.empty() && std::isspace(static_cast<unsigned char>(field.back()))) field.remove_suffix(1);
    if (!field.empty() && field.front() == '+') field.remove_prefix(1);
    int64_t v = 0;
    auto [p, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
    MOE_CHECK(!field.empty() && ec == std::errc() && p == field.data() + field.size(),
              "[tokenizer] NullTokenizer: '{}' is not an integer token id (the text must be ids "
              "separated by single spaces)",
              std::string(text.substr(start, end - start)));
    // An id past the vocabulary would index past the embedding table in training.
    MOE_CHECK(v >= 0 && v < vocab_,
              "[tokenizer] NullTokenizer: token id {} is outside the vocabulary [0, {}) of "
              "--vocab-size {}: raise --vocab-size or fix the text",
              v, vocab_, vocab_);
    out.push_back(v);
    if (end == text.size()) break;
    start = end + 1;
  }
}

std::string NullTokenizer::describe() const {
  return fmt::format("NullTokenizer (vocab {}, eod {})", vocab_, vocab_ - 1);
}

const char* tokenizer_types() {
  return "ByteLevel, NullTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, "
         "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer";
}

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerConfig& cfg) {
  if (cfg.type == "ByteLevel") return std::make_unique<ByteLevelTokenizer>();
  if (cfg.type == "NullTokenizer") {
    return std::make_unique<NullTokenizer>(cfg.vocab_size);
  }
  if (cfg.type == "GPT2BPETokenizer") {
    return std::make_unique<Gpt2BpeTokenizer>(cfg.vocab_file, cfg.merge_file);
  }
  if (cfg.type == "HuggingFaceTokenizer") {
    return std::make_unique<HuggingFaceTokenizer>(cfg.tokenizer_model);
  }
  if (cfg.type == "SentencePieceTokenizer" || cfg.type == "GPTSentencePieceTokenizer" ||
      cfg.type == "Llama2Tokenizer") {
    return std::make_unique<SentencePieceTokenizer>(cfg.tokenizer_model, cfg.type);
  }
  MOE_FAIL("[tokenizer] --tokenizer-type {} is not implemented: use one of {}", cfg.type,
           tokenizer_types());
}

}  // namespace moecore::data
