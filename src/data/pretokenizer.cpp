#include "data/pretokenizer.h"

#include <cstdint>

#include "core/check.h"
#include "data/unicode_classes.h"

namespace moecore::data {

namespace {

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The text as code points with their classes; index n is a sentinel (end of text).
struct CodePoints {
  std::vector<uint32_t> cp;
  std::vector<size_t> offset;  // byte offset of each code point, and the text size at n
  size_t n = 0;
  explicit CodePoints(std::string_view text) {
    for (size_t pos = 0, len = 0; pos < text.size(); pos += len) {
      cp.push_back(decode_utf8(text, pos, &len));
      offset.push_back(pos);
    }
    n = cp.size();
    offset.push_back(text.size());
  }
  bool letter(size_t i) const { return i < n && is_letter(cp[i]); }
  bool number(size_t i) const { return i < n && is_number(cp[i]); }
  bool space(size_t i) const { return i < n && is_whitespace(cp[i]); }
  bool newline(size_t i) const { return i < n && (cp[i] == '\r' || cp[i] == '\n'); }
  // [^\s\p{L}\p{N}]
  bool other(size_t i) const { return i < n && !space(i) && !letter(i) && !number(i); }
  bool is(size_t i, char c) const { return i < n && cp[i] == static_cast<uint32_t>(c); }
  // One ASCII letter, or with (?i) its other case (and U+017F LONG S, which folds to s).
  bool is_ci(size_t i, char lower) const {
    if (i >= n) return false;
    const uint32_t c = cp[i];
    return c == static_cast<uint32_t>(lower) || c == static_cast<uint32_t>(lower - 'a' + 'A') ||
           (lower == 's' && c == 0x17F);
  }
};

// 's|'t|'re|'ve|'m|'ll|'d (case-insensitively for Llama-3): the match length, or 0.
size_t contraction(const CodePoints& t, size_t i, bool ci) {
  if (!t.is(i, '\'')) return 0;
  auto eq = [&](size_t j, char c) { return ci ? t.is_ci(j, c) : t.is(j, c); };
  if (eq(i + 1, 's') || eq(i + 1, 't') || eq(i + 1, 'm') || eq(i + 1, 'd')) return 2;
  if ((eq(i + 1, 'r') && eq(i + 2, 'e')) || (eq(i + 1, 'v') && eq(i + 2, 'e')) ||
      (eq(i + 1, 'l') && eq(i + 2, 'l'))) {
    return 3;
  }
  return 0;
}

// \s+(?!\S)|\s+ at i (a whitespace code point): the whole run when it ends the text or the
// run is one code point, else the run but its last code point, which then leads the next piece.
size_t whitespace_run(const CodePoints& t, size_t i) {
  size_t j = i;
  while (t.space(j)) ++j;
  if (j == t.n || j - i == 1) return j - i;
  return j - i - 1;
}

size_t match_gpt2(const CodePoints& t, size_t i) {
  if (size_t m = contraction(t, i, false)) return m;
  const size_t s = t.is(i, ' ') ? i + 1 : i;  // " ?"
  size_t j = s;
  if (t.letter(s)) {
    while (t.letter(j)) ++j;
    return j - i;
  }
  if (t.number(s)) {
    while (t.number(j)) ++j;
    return j - i;
  }
  if (t.other(s)) {
    while (t.other(j)) ++j;
    return j - i;
  }
  if (t.space(i)) return whitespace_run(t, i);
  return 1;  // unreachable: every code point is a letter, a number, a space or other
}

size_t match_llama3(const CodePoints& t, size_t i, size_t max_digits) {
  if (size_t m = contraction(t, i, true)) return m;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  {
    size_t s = i;
    if (!t.letter(i) && !t.number(i) && !t.newline(i) && i < t.n) s = i + 1;
    if (!t.letter(s)) s = i;  // the optional code point is given back
    if (t.letter(s)) {
      size_t j = s;
      while (t.letter(j)) ++j;
      return j - i;
    }
  }
  // \p{N}{1,3}
  if (t.number(i)) {
    size_t j = i;
    while (j - i < max_digits && t.number(j)) ++j;
    return j - i;
  }
  // " ?[^\s\p{L}\p{N}]+[\r\n]*"
  {
    const size_t s = t.is(i, ' ') && t.other(i + 1) ? i + 1 : i;
    if (t.other(s)) {
      size_t j = s;
      while (t.other(j)) ++j;
      while (t.newline(j)) ++j;
      return j - i;
    }
  }
  if (!t.space(i)) return 1;  // unreachable, as above
  // \s*[\r\n]+: the whitespace run up to and including its last \r or \n.
  size_t j = i, last_newline = t.n;
  while (t.space(j)) {
    if (t.newline(j)) last_newline = j;
    ++j;
  }
  if (last_newline != t.n) return last_newline + 1 - i;
  return whitespace_run(t, i);
}

}  // namespace

PreTokenizerPattern pretokenizer_pattern_from_regex(const std::string& regex) {
  if (regex == kGpt2Regex) return PreTokenizerPattern::Gpt2;
  if (regex == kLlama3Regex) return PreTokenizerPattern::Llama3;
  if (regex == kQwen2Regex) return PreTokenizerPattern::Qwen2;
  MOE_FAIL(
      "[tokenizer] pre-tokenizer regex '{}' is not implemented: moecore scans GPT-2's ({}), "
      "Llama-3's ({}) and Qwen2's ({}) patterns",
      regex, kGpt2Regex, kLlama3Regex, kQwen2Regex);
}

const char* pretokenizer_pattern_regex(PreTokenizerPattern p) {
  switch (p) {
    case PreTokenizerPattern::Gpt2:
      return kGpt2Regex;
    case PreTokenizerPattern::Llama3:
      return kLlama3Regex;
    case PreTokenizerPattern::Qwen2:
      return kQwen2Regex;
  }
  return "";
}

void pretokenize(PreTokenizerPattern p, std::string_view text, std::vector<std::string_view>& out) {
  const CodePoints t(text);
  for (size_t i = 0; i < t.n;) {
    const size_t m = p == PreTokenizerPattern::Gpt2
                         ? match_gpt2(t, i)
                         : match_llama3(t, i, p == PreTokenizerPattern::Llama3 ? 3 : 1);
    out.push_back(text.substr(t.offset[i], t.offset[i + m] - t.offset[i]));
    i += m;
  }
}

}  // namespace moecore::data
