// SHA-256 of checkpoint files (OpenSSL's libcrypto), as 64 lowercase hex digits: the manifest
// records one per shard, so a shard altered or swapped after the save is caught before its
// tensors are used.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace moecore::ckpt {

// A SHA-256 fed piece by piece: a shard streamed to its file is hashed as it is written, and a
// shard read back in chunks is hashed chunk by chunk, without holding the whole.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(std::span<const std::byte> data);
  // The digest of everything fed since construction or the last finish(), as 64 lowercase hex
  // digits; the hasher starts afresh.
  std::string finish();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

// The digest of the concatenation of `pieces` (a shard's header and data, hashed as written).
std::string sha256_hex(std::span<const std::span<const std::byte>> pieces);
std::string sha256_hex(std::span<const std::byte> data);
std::string sha256_hex(std::string_view text);
// 64 lowercase hex digits.
bool is_sha256_hex(std::string_view s);

}  // namespace moecore::ckpt
