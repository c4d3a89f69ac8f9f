// Unicode Normalization Form C (canonical decomposition, canonical ordering, canonical
// composition), the normalizer of Qwen2's tokenizer.json. Tables generated from Python's
// unicodedata by tools/make_tokenizer_fixtures.py (unicode_nfc.inc); Hangul syllables are
// composed and decomposed algorithmically, as the standard defines them.
#pragma once

#include <string>
#include <string_view>

namespace moecore::data {

// NFC of UTF-8 text (malformed bytes pass through unchanged, as U+FFFD would not round-trip).
void nfc_normalize(std::string_view text, std::string& out);

}  // namespace moecore::data
