// Added (special) tokens, split out of the text before pre-tokenization: the leftmost
// occurrence of any of them, the longest one where several start there (HuggingFace
// tokenizers' rule). The text between them is tokenized normally.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moecore::data {

class AddedTokens {
 public:
  void add(const std::string& content, int64_t id);
  bool empty() const { return count_ == 0; }

  struct Match {
    size_t pos = std::string_view::npos, length = 0;
    int64_t id = -1;
  };
  // The first added token in text at or after `from` (pos npos: none).
  Match find(std::string_view text, size_t from) const;

 private:
  struct Entry {
    std::string content;
    int64_t id;
  };
  std::array<std::vector<Entry>, 256> by_first_byte_;  // longest first
  size_t count_ = 0;
};

}  // namespace moecore::data
