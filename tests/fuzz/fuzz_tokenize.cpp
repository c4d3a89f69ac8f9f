// libFuzzer target for the text side of the tokenizers (the corpus is untrusted input too): any
// bytes, valid UTF-8 or not, go through the NFC normalizer, the three pre-tokenizer scanners
// (src/data/pretokenizer.cpp) and the committed HuggingFace tokenizers (GPT-2, Llama-3 and
// Qwen2's, tests/fixtures/tokenizers/). The pieces must cover the text exactly, in order, none
// empty; NFC must be idempotent; every id must lie in [0, vocab_size()).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "data/hf_tokenizer.h"
#include "data/pretokenizer.h"
#include "data/unicode_nfc.h"
#include "fuzz_common.h"

namespace {

using namespace moecore::data;

const std::vector<std::unique_ptr<HuggingFaceTokenizer>>& tokenizers() {
  static const auto all = [] {
    std::vector<std::unique_ptr<HuggingFaceTokenizer>> out;
    for (const char* dir : {"hf_gpt2", "hf_llama3", "hf_qwen2"}) {
      out.push_back(std::make_unique<HuggingFaceTokenizer>(
          std::string(MOECORE_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + dir));
    }
    return out;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string nfc, nfc2;
  nfc_normalize(text, nfc);
  nfc_normalize(nfc, nfc2);
  FUZZ_EXPECT(nfc2 == nfc);

  std::vector<std::string_view> pieces;
  for (PreTokenizerPattern p :
       {PreTokenizerPattern::Gpt2, PreTokenizerPattern::Llama3, PreTokenizerPattern::Qwen2}) {
    pieces.clear();
    pretokenize(p, text, pieces);
    const char* at = text.data();
    for (std::string_view piece : pieces) {
      FUZZ_EXPECT(!piece.empty() && piece.data() == at);
      at += piece.size();
    }
    FUZZ_EXPECT(at == text.data() + text.size());
  }

  std::vector<int64_t> ids;
  for (const auto& tok : tokenizers()) {
    ids.clear();
    try {
      tok->tokenize(text, ids);
    } catch (const moecore::Error&) {
      // text is never refused; a check firing here is a finding
      moecore::fuzz::violated("tokenize threw moecore::Error on text");
    }
    for (int64_t id : ids) FUZZ_EXPECT(id >= 0 && id < tok->vocab_size());
  }
  return 0;
}
