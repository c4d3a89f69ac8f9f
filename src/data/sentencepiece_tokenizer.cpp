#include "data/sentencepiece_tokenizer.h"

#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include "core/check.h"
#include "data/mapped_file.h"

namespace moecore::data {

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& model_file,
                                               const std::string& type)
    : model_file_(model_file),
      type_(type),
      sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  MOE_CHECK(!model_file.empty(),
            "[tokenizer] {} needs --tokenizer-model (a SentencePiece .model "
            "file)",
            type);
  const std::string why = unreadable_reason(model_file);
  MOE_CHECK(why.empty(), "[tokenizer] --tokenizer-model '{}': {}", model_file, why);
  const auto status = sp_->Load(model_file);
  MOE_CHECK(status.ok(), "[tokenizer] --tokenizer-model '{}' is not a SentencePiece model: {}",
            model_file, status.ToString());
  vocab_size_ = sp_->GetPieceSize();
  eos_ = sp_->eos_id();
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

int64_t SentencePieceTokenizer::eod() const {
  MOE_CHECK(eos_ >= 0,
            "[tokenizer] {} '{}': the model has no eos piece, which is the end of "
            "document",
            type_, model_file_);
  return eos_;
}

void SentencePieceTokenizer::tokenize(std::string_view text, std::vector<int64_t>& out) const {
  std::vector<int> ids;
  const auto status = sp_->Encode(absl::string_view(text.data(), text.size()), &ids);
  MOE_CHECK(status.ok(), "[tokenizer] {} '{}' cannot encode a text: {}", type_, model_file_,
            status.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::describe() const {
  return fmt::format("{} ('{}', vocab {}, eod {})", type_, model_file_, vocab_size_, eos_);
}

}  // namespace moecore::data
