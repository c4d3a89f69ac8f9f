#include "data/sentencepiece_tokenizer.h"

#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include "core/check.h"
#include "data/mapped_file.h"

namespace moecore::data {

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& model_file,
                                               SentencePieceFlavour flavour)
    : model_file_(model_file),
      flavour_(flavour),
      sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  MOE_CHECK(!model_file.empty(), "[tokenizer] the SentencePiece tokenizers need --tokenizer-model "
            "(a .model file)");
  const std::string why = unreadable_reason(model_file);
  MOE_CHECK(why.empty(), "[tokenizer] --tokenizer-model '{}': {}", model_file, why);
  const auto status = sp_->Load(model_file);
  MOE_CHECK(status.ok(), "[tokenizer] --tokenizer-model '{}' is not a SentencePiece model: {}",
            model_file, status.ToString());
  const int64_t n = sp_->GetPieceSize();
  if (flavour != SentencePieceFlavour::Megatron) {
    vocab_size_ = n;
    eod_ = sp_->eos_id();
    MOE_CHECK(eod_ >= 0, "[tokenizer] --tokenizer-model '{}' has no eos piece: {} takes eod from it",
              model_file,
              flavour == SentencePieceFlavour::Gpt ? "GPTSentencePieceTokenizer" : "Llama2Tokenizer");
    if (flavour == SentencePieceFlavour::Llama2) {
      bos_ = sp_->bos_id();
      MOE_CHECK(bos_ >= 0, "[tokenizer] --tokenizer-model '{}' has no bos piece: Llama2Tokenizer "
                "starts every text with it", model_file);
    }
    return;
  }
  // Megatron's _SentencePieceTokenizer: its special tokens are pieces of the model when it has
  // them, else new ids after the model's.
  int64_t next = n;
  auto add = [&](const std::string& piece) {
    for (const auto& s : special_) {
      if (s.first == piece) return s.second;
    }
    const int64_t id = sp_->PieceToId(piece);
    // PieceToId answers unk for an unknown piece: only the unk piece itself maps to unk.
    const bool known = id >= 0 && id < n && sp_->IdToPiece(static_cast<int>(id)) == piece;
    special_.emplace_back(piece, known ? id : next++);
    return special_.back().second;
  };
  add("<CLS>");
  add("<SEP>");
  eod_ = add("<EOD>");
  add("<MASK>");
  auto piece_or = [&](int id, const char* name) {
    return id >= 0 && id < n ? sp_->IdToPiece(id) : std::string(name);
  };
  add(piece_or(sp_->pad_id(), "<PAD>"));
  add(piece_or(sp_->bos_id(), "<BOS>"));
  add(piece_or(sp_->eos_id(), "<EOS>"));
  vocab_size_ = next;
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

void SentencePieceTokenizer::encode(std::string_view text, std::vector<int64_t>& out) const {
  std::vector<int> ids;
  const auto status = sp_->Encode(absl::string_view(text.data(), text.size()), &ids);
  MOE_CHECK(status.ok(), "[tokenizer] SentencePiece '{}' cannot encode a text: {}", model_file_,
            status.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

void SentencePieceTokenizer::tokenize(std::string_view text, std::vector<int64_t>& out) const {
  if (flavour_ == SentencePieceFlavour::Llama2) out.push_back(bos_);
  if (flavour_ != SentencePieceFlavour::Megatron) {
    encode(text, out);
    return;
  }
  for (size_t pos = 0;;) {
    size_t best = std::string_view::npos;
    const std::pair<std::string, int64_t>* which = nullptr;
    for (const auto& s : special_) {
      const size_t at = text.find(s.first, pos);
      if (at < best) best = at, which = &s;  // strictly earlier: the first in order on ties
    }
    if (which == nullptr) {
      encode(text.substr(pos), out);
      return;
    }
    encode(text.substr(pos, best - pos), out);
    out.push_back(which->second);
    pos = best + which->first.size();
  }
}

std::string SentencePieceTokenizer::describe() const {
  const char* name = flavour_ == SentencePieceFlavour::Megatron ? "SentencePieceTokenizer"
                     : flavour_ == SentencePieceFlavour::Gpt    ? "GPTSentencePieceTokenizer"
                                                                : "Llama2Tokenizer";
  return fmt::format("{} ('{}', vocab {}, eod {})", name, model_file_, vocab_size_, eod_);
}

}  // namespace moecore::data
