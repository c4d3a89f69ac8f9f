#include "ckpt/shard_digest.h"

#include <algorithm>
#include <bit>

#include "core/check.h"

namespace moecore::ckpt {

uint64_t chunk_bytes_for(uint64_t file_bytes) {
  const uint64_t per = (file_bytes + kMaxChunksPerShard - 1) / kMaxChunksPerShard;
  return std::max(kMinChunkBytes, std::bit_ceil(std::max<uint64_t>(per, 1)));
}

ShardDigester::ShardDigester(uint64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
  MOE_CHECK(chunk_bytes > 0, "[ckpt] a shard's chunks cannot be 0 bytes");
}

void ShardDigester::update(std::span<const std::byte> data) {
  whole_.update(data);
  bytes_ += data.size();
  while (!data.empty()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(data.size(), chunk_bytes_ - in_chunk_));
    chunk_.update(data.first(n));
    in_chunk_ += n;
    data = data.subspan(n);
    if (in_chunk_ == chunk_bytes_) {
      chunks_.push_back(chunk_.finish());
      in_chunk_ = 0;
    }
  }
}

void ShardDigester::finish(ShardFile& f) {
  if (in_chunk_ > 0) chunks_.push_back(chunk_.finish());
  in_chunk_ = 0;
  f.bytes = bytes_;
  f.sha256 = whole_.finish();
  f.chunk_bytes = chunk_bytes_;
  f.chunk_sha256 = std::move(chunks_);
  chunks_.clear();
  bytes_ = 0;
}

}  // namespace moecore::ckpt
