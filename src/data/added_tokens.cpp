#include "data/added_tokens.h"

#include <algorithm>

#include "core/check.h"

namespace moecore::data {

void AddedTokens::add(const std::string& content, int64_t id) {
  MOE_CHECK(!content.empty(), "[tokenizer] added token {} is empty", id);
  auto& bucket = by_first_byte_[static_cast<uint8_t>(content[0])];
  for (const Entry& e : bucket) {
    if (e.content == content) return;
  }
  bucket.push_back({content, id});
  std::stable_sort(bucket.begin(), bucket.end(), [](const Entry& a, const Entry& b) {
    return a.content.size() > b.content.size();
  });
  ++count_;
}

AddedTokens::Match AddedTokens::find(std::string_view text, size_t from) const {
  for (size_t p = from; p < text.size(); ++p) {
    const auto& bucket = by_first_byte_[static_cast<uint8_t>(text[p])];
    for (const Entry& e : bucket) {
      if (text.compare(p, e.content.size(), e.content) == 0) return {p, e.content.size(), e.id};
    }
  }
  return {};
}

}  // namespace moecore::data
