// The Unicode character classes the pre-tokenizer regexes of GPT-2, Llama-3 and Qwen2 use
// (\p{L}, \p{N}, \s), and UTF-8 decoding to code points. std::regex has no \p{...}, so the
// scanners in pretokenizer.cpp test code points against these tables (generated from Python's
// unicodedata by tools/make_tokenizer_fixtures.py: unicode_classes.inc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moecore::data {

struct CodePointRange {
  uint32_t first, last;  // inclusive
};

bool is_letter(uint32_t cp);      // general category L*
bool is_number(uint32_t cp);      // general category N*
bool is_whitespace(uint32_t cp);  // the White_Space property (the regex engines' \s)

// The code point starting at text[pos] and its length in bytes. A malformed sequence is one
// byte long and decodes to U+FFFD (the regex engines' "other" class), so the bytes are kept.
uint32_t decode_utf8(std::string_view text, size_t pos, size_t* length);

}  // namespace moecore::data
