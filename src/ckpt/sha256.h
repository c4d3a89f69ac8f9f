// SHA-256 of checkpoint files (OpenSSL's libcrypto), as 64 lowercase hex digits: the manifest
// records one per shard, so a shard altered or swapped after the save is caught before its
// tensors are used.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace moecore::ckpt {

// The digest of the concatenation of `pieces` (a shard's header and data, hashed as written).
std::string sha256_hex(std::span<const std::span<const std::byte>> pieces);
std::string sha256_hex(std::span<const std::byte> data);
std::string sha256_hex(std::string_view text);
// 64 lowercase hex digits.
bool is_sha256_hex(std::string_view s);

}  // namespace moecore::ckpt
