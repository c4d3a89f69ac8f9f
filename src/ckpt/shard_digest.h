// The digests a manifest records of each shard: the SHA-256 of the whole file (what recovery,
// `checkpoint compare` and older readers check) and of each chunk of it, so that a load verifies
// every byte it reads by reading and hashing only the chunks that hold them. Both are computed
// as the shard is streamed to its file, in one pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ckpt/manifest.h"
#include "ckpt/sha256.h"

namespace moecore::ckpt {

// The chunk size of a shard of `file_bytes` bytes: at least kMinChunkBytes (a read of a few
// bytes reads one such chunk), a power of two, and at most kMaxChunksPerShard chunks (each
// digest is 66 bytes of the manifest, which every rank parses: 1024 digests for a shard of any
// size, 64 KiB chunks up to a 64 MiB shard, 16 MiB chunks for a 16 GiB one).
inline constexpr uint64_t kMinChunkBytes = uint64_t{64} << 10;
inline constexpr uint64_t kMaxChunksPerShard = 1024;
uint64_t chunk_bytes_for(uint64_t file_bytes);

// Hashes a file fed in order, piece by piece: the whole file and each chunk.
class ShardDigester {
 public:
  // chunk_bytes > 0.
  explicit ShardDigester(uint64_t chunk_bytes);
  void update(std::span<const std::byte> data);
  // Sets f's bytes, sha256, chunk_bytes and chunk_sha256 from what was fed.
  void finish(ShardFile& f);

 private:
  uint64_t chunk_bytes_;
  uint64_t bytes_ = 0;
  uint64_t in_chunk_ = 0;  // bytes of the current chunk fed so far
  Sha256 whole_, chunk_;
  std::vector<std::string> chunks_;
};

}  // namespace moecore::ckpt
