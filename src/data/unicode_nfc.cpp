#include "data/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

#include "data/unicode_classes.h"

namespace moecore::data {

namespace {

struct CombiningClassRange {
  uint32_t first, last;
  uint8_t ccc;
};
struct Decomposition {
  uint32_t cp;
  uint16_t offset;
  uint8_t length;
};
struct Composition {
  uint32_t first, second, composite;
};

#include "data/unicode_nfc.inc"

constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  const auto* it =
      std::lower_bound(std::begin(kCombiningClasses), std::end(kCombiningClasses), cp,
                       [](const CombiningClassRange& r, uint32_t v) { return r.last < v; });
  return it != std::end(kCombiningClasses) && it->first <= cp ? it->ccc : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* it = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), cp,
                                    [](const Decomposition& d, uint32_t v) { return d.cp < v; });
  if (it != std::end(kDecompositions) && it->cp == cp) {
    out.insert(out.end(), kDecompositionData + it->offset,
               kDecompositionData + it->offset + it->length);
  } else {
    out.push_back(cp);
  }
}

// The primary composite of (a, b), or 0.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto* it =
      std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{a, b},
                       [](const Composition& c, std::pair<uint32_t, uint32_t> v) {
                         return c.first < v.first || (c.first == v.first && c.second < v.second);
                       });
  return it != std::end(kCompositions) && it->first == a && it->second == b ? it->composite : 0;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// NFC of a run of well-formed code points that starts with a starter (or the text), appended to
// out. d and c are scratch buffers.
void normalize_run(const std::vector<uint32_t>& cps, std::vector<uint32_t>& d,
                   std::vector<uint32_t>& c, std::string& out) {
  if (cps.size() == 1 && cps[0] < 0xC0) {  // nothing below U+00C0 decomposes or composes
    append_utf8(cps[0], out);
    return;
  }
  d.clear();
  for (uint32_t cp : cps) decompose(cp, d);
  // Canonical ordering: each run of non-starters stably sorted by combining class.
  for (size_t i = 0; i < d.size();) {
    if (combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && combining_class(d[j]) != 0) ++j;
    std::stable_sort(
        d.begin() + static_cast<std::ptrdiff_t>(i), d.begin() + static_cast<std::ptrdiff_t>(j),
        [](uint32_t a, uint32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // Canonical composition: a character combines with the last starter unless blocked, i.e.
  // unless a character between them has class 0 or a class >= its own (after the ordering, the
  // one just before it has the largest class between them).
  c.clear();
  size_t starter = SIZE_MAX;
  for (uint32_t cp : d) {
    const int k = combining_class(cp);
    if (starter != SIZE_MAX) {
      const bool adjacent = c.size() == starter + 1;
      const int prev = combining_class(c.back());
      if (adjacent || (prev != 0 && prev < k)) {
        if (const uint32_t comp = compose(c[starter], cp)) {
          c[starter] = comp;
          continue;
        }
      }
    }
    if (k == 0) starter = c.size();
    c.push_back(cp);
  }
  for (uint32_t cp : c) append_utf8(cp, out);
}

}  // namespace

void nfc_normalize(std::string_view text, std::string& out) {
  out.clear();
  std::vector<uint32_t> run, d, c;
  // Runs are cut before each ASCII character: it is a starter, composes with nothing before it
  // and stops the reordering, so each run normalizes on its own.
  for (size_t pos = 0, len = 0; pos < text.size(); pos += len) {
    const uint32_t cp = decode_utf8(text, pos, &len);
    const bool malformed = cp == 0xFFFD && len == 1;
    if (cp < 0x80 || malformed) {
      if (!run.empty()) normalize_run(run, d, c, out);
      run.clear();
    }
    if (malformed) {
      out.append(text.substr(pos, len));  // a malformed byte, kept as it is
      continue;
    }
    run.push_back(cp);
  }
  if (!run.empty()) normalize_run(run, d, c, out);
}

}  // namespace moecore::data
