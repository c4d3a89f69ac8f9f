#include "data/byte_text_dataset.h"

#include <fmt/format.h>

#include <fstream>
#include <numeric>
#include <iterator>

#include "core/check.h"
#include "core/rng.h"
#include "data/mapped_file.h"

namespace moecore::data {

ByteTextDataset::ByteTextDataset(const std::string& path, int64_t seq_length, uint64_t seed)
    : path_(path), S_(seq_length), key_(rng_key(seed, "data.byte_text.shuffle")) {
  const std::string why = unreadable_reason(path);
  MOE_CHECK(why.empty(), "[data] --data-path '{}' {}", path, why);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "[data] cannot open --data-path '{}': check the path", path);
  bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  MOE_CHECK(static_cast<int64_t>(bytes_.size()) >= seq_length + 1,
            "[data] '{}' has {} bytes, fewer than --seq-length + 1 = {}: use a longer file or a "
            "shorter --seq-length",
            path, bytes_.size(), seq_length + 1);
  n_windows_ = (static_cast<int64_t>(bytes_.size()) - 1) / seq_length;
}

void ByteTextDataset::sample(int32_t* tokens, int64_t len, uint64_t index) const {
  MOE_CHECK(len <= S_ + 1, "[data] sample of {} tokens > seq_length + 1 = {}", len, S_ + 1);
  // A fresh order per epoch without materialising it: the affine bijection i -> (a i + b) mod n
  // with a coprime to n, a and b drawn per epoch.
  const uint64_t n = static_cast<uint64_t>(n_windows_);
  const uint64_t epoch = index / n, i = index % n;
  uint64_t window = 0;
  if (n > 1) {
    uint64_t a = 1 + static_cast<uint64_t>(rng_uniform(key_, epoch, 0) * static_cast<double>(n - 1));
    while (std::gcd(a, n) != 1) ++a;  // terminates: gcd(n - 1, n) = 1
    uint64_t b = static_cast<uint64_t>(rng_uniform(key_, epoch, 1) * static_cast<double>(n));
    window = (a * i + b) % n;
  }
  const uint8_t* p = bytes_.data() + window * S_;
  for (int64_t t = 0; t < len; ++t) tokens[t] = p[t];
}

std::string ByteTextDataset::describe() const {
  return fmt::format("byte-level text '{}' ({} bytes, {} windows of {} tokens)", path_,
                     bytes_.size(), n_windows_, S_ + 1);
}

}  // namespace moecore::data
