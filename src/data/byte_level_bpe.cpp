#include "data/byte_level_bpe.h"

#include <array>
#include <limits>

#include "core/check.h"

namespace moecore::data {

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's map: printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') are their own code
// point; the other 68 bytes, in order, are U+0100, U+0101, ...
struct ByteMap {
  std::array<std::string, 256> spelled;
  std::unordered_map<std::string, uint8_t> back;
  ByteMap() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      spelled[b] = utf8(printable ? b : next++);
      back[spelled[b]] = static_cast<uint8_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

}  // namespace

const std::string& byte_to_unicode(uint8_t b) {
  return byte_map().spelled[b];
}

bool unicode_to_bytes(std::string_view spelled, std::string* bytes) {
  const ByteMap& m = byte_map();
  bytes->clear();
  for (size_t i = 0; i < spelled.size();) {
    const size_t n = static_cast<uint8_t>(spelled[i]) < 0x80 ? 1 : 2;
    auto it = m.back.find(std::string(spelled.substr(i, n)));
    if (it == m.back.end()) return false;
    bytes->push_back(static_cast<char>(it->second));
    i += n;
  }
  return true;
}

ByteLevelBpe::ByteLevelBpe(const std::unordered_map<std::string, int64_t>& vocab,
                           const std::vector<std::pair<std::string, std::string>>& merges,
                           bool ignore_merges, const std::string& what)
    : ignore_merges_(ignore_merges) {
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(byte_to_unicode(static_cast<uint8_t>(b)));
    MOE_CHECK(it != vocab.end(),
              "[tokenizer] {}: the vocabulary has no token for byte 0x{:02X} ('{}'): a byte-level "
              "BPE vocabulary holds all 256 bytes",
              what, b, byte_to_unicode(static_cast<uint8_t>(b)));
    byte_id_[b] = it->second;
  }
  for (const auto& [spelled, id] : vocab) {
    MOE_CHECK(id >= 0 && id < (int64_t{1} << 31), "[tokenizer] {}: token '{}' has id {}", what,
              spelled, id);
    if (!ignore_merges) continue;
    std::string bytes;
    if (unicode_to_bytes(spelled, &bytes)) by_bytes_.emplace(bytes, id);
  }
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
    MOE_CHECK(ia != vocab.end() && ib != vocab.end() && im != vocab.end(),
              "[tokenizer] {}: merge {} '{} {}' names a token that is not in the vocabulary", what,
              r + 1, a, b);
    // A pair listed twice keeps its first (lowest) rank, as the reference implementations do.
    merges_.emplace(key(ia->second, ib->second), Merge{static_cast<int32_t>(r), im->second});
  }
}

void ByteLevelBpe::encode(std::string_view piece, std::vector<int64_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    auto it = by_bytes_.find(std::string(piece));
    if (it != by_bytes_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const size_t begin = out.size();
  for (unsigned char c : piece) out.push_back(byte_id_[c]);
  // Merge the lowest-ranked adjacent pair (leftmost on ties) until none has a merge. Pieces
  // are short (a word), so the quadratic scan beats a heap.
  while (out.size() - begin >= 2) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t at = 0;
    int64_t merged = 0;
    for (size_t i = begin; i + 1 < out.size(); ++i) {
      auto it = merges_.find(key(out[i], out[i + 1]));
      if (it != merges_.end() && it->second.rank < best) {
        best = it->second.rank;
        at = i;
        merged = it->second.id;
      }
    }
    if (best == std::numeric_limits<int32_t>::max()) break;
    out[at] = merged;
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
}

}  // namespace moecore::data
