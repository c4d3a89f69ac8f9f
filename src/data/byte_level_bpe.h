// Byte-level BPE, the model under GPT-2's, Llama-3's and Qwen2's tokenizers: every byte of a
// pre-tokenized piece is a symbol (spelled in vocab files through GPT-2's byte-to-unicode map,
// so that every byte is a printable character), and adjacent symbols merge, lowest merge rank
// first (leftmost on ties), until no adjacent pair has a merge.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moecore::data {

// GPT-2's bytes_to_unicode: byte b's character, UTF-8 encoded.
const std::string& byte_to_unicode(uint8_t b);
// A vocab entry's spelling back to its bytes; false when a character is not one of the 256.
bool unicode_to_bytes(std::string_view spelled, std::string* bytes);

class ByteLevelBpe {
 public:
  // vocab: spelled token -> id; merges: pairs of spelled tokens, in rank order.
  // ignore_merges: a piece that is itself in the vocabulary is that token, unmerged
  // (tokenizers' BPE option, set by Llama-3's tokenizer.json). `what` names the files.
  ByteLevelBpe(const std::unordered_map<std::string, int64_t>& vocab,
               const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
               const std::string& what);

  // Appends the ids of one pre-tokenized piece (raw bytes).
  void encode(std::string_view piece, std::vector<int64_t>& out) const;

 private:
  struct Merge {
    int32_t rank;
    int64_t id;
  };
  static uint64_t key(int64_t a, int64_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b);
  }
  int64_t byte_id_[256];
  std::unordered_map<uint64_t, Merge> merges_;         // (left id, right id) -> rank, merged id
  std::unordered_map<std::string, int64_t> by_bytes_;  // raw bytes -> id (ignore_merges)
  bool ignore_merges_;
};

}  // namespace moecore::data
