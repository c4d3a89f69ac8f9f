// libFuzzer target for HuggingFace's tokenizer.json (src/data/hf_tokenizer.cpp and what it
// builds: byte-level BPE, added tokens, the pre-tokenizer pattern, NFC) and the
// tokenizer_config.json beside it: any bytes either give a tokenizer whose every id, for any
// text, lies in [0, vocab_size()) (and whose eod, when it has one, too), or fail with
// moecore::Error.
//
// Input: tokenizer.json, then optionally a NUL byte and tokenizer_config.json (JSON text holds
// no raw NUL). Without the NUL there is no tokenizer_config.json. The seeds
// (tests/fuzz/corpus/hf_tokenizer/) are small tokenizers and the committed ones.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "data/hf_tokenizer.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::data;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string json = moecore::fuzz::write_file("tokenizer.json", input.substr(0, nul));
  if (nul == std::string_view::npos) {
    moecore::fuzz::remove_file("tokenizer_config.json");
  } else {
    moecore::fuzz::write_file("tokenizer_config.json", input.substr(nul + 1));
  }
  try {
    const HuggingFaceTokenizer tok(json);
    const int64_t vocab = tok.vocab_size();
    FUZZ_EXPECT(vocab >= 1);
    try {
      const int64_t eod = tok.eod();
      FUZZ_EXPECT(eod >= 0 && eod < vocab);
    } catch (const moecore::Error&) {
      // no eos_token: eod() says why
    }
    (void)tok.describe();
    std::vector<int64_t> ids;
    // Some text every tokenizer splits differently, and the input itself (any bytes; capped:
    // BPE is quadratic in a piece's length).
    for (std::string_view text :
         {std::string_view("Hello world! It's 2026, \xc3\xa9t\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac "
                           "<|endoftext|> \xf0\x9f\x98\x80\r\n  x"),
          input.substr(0, 512)}) {
      ids.clear();
      tok.tokenize(text, ids);
      for (int64_t id : ids) FUZZ_EXPECT(id >= 0 && id < vocab);
    }
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
