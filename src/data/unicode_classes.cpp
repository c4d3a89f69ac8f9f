#include "data/unicode_classes.h"

#include <algorithm>
#include <iterator>

namespace moecore::data {

namespace {

#include "data/unicode_classes.inc"

template <size_t N>
bool in_ranges(const CodePointRange (&ranges)[N], uint32_t cp) {
  // The first range whose last >= cp.
  const CodePointRange* it =
      std::lower_bound(std::begin(ranges), std::end(ranges), cp,
                       [](const CodePointRange& r, uint32_t v) { return r.last < v; });
  return it != std::end(ranges) && it->first <= cp;
}

}  // namespace

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) - 'a' < 26;
  return in_ranges(kLetterRanges, cp);
}

bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp - '0' < 10;
  return in_ranges(kNumberRanges, cp);
}

bool is_whitespace(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

uint32_t decode_utf8(std::string_view text, size_t pos, size_t* length) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(text[pos + i]); };
  const uint8_t c = b(0);
  const size_t left = text.size() - pos;
  size_t n = 0;
  uint32_t cp = 0;
  if (c < 0x80) {
    *length = 1;
    return c;
  } else if ((c & 0xE0) == 0xC0) {
    n = 2, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, cp = c & 0x07;
  }
  bool ok = n > 0 && n <= left;
  for (size_t i = 1; ok && i < n; ++i) {
    ok = (b(i) & 0xC0) == 0x80;
    cp = (cp << 6) | (b(i) & 0x3F);
  }
  // Overlong forms, surrogates and values past U+10FFFF are malformed too.
  static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (!ok || cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    *length = 1;
    return 0xFFFD;
  }
  *length = n;
  return cp;
}

}  // namespace moecore::data
