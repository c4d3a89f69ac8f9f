// One shard of a checkpoint opened for reading byte ranges: the header is read (pread) and
// validated as SafetensorsFile validates a whole file, then only the ranges a reader asks for,
// each byte verified against the manifest's digests before it is used (the chunks that hold it
// read whole and hashed). Nothing of the file is kept but its header and one verified chunk per
// CheckpointReader, so a rank that loads a few slices of a large checkpoint reads, hashes and
// holds about those bytes only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/safetensors_file.h"

namespace moecore::ckpt {

// When a checkpoint's shards are checked against the manifest's digests.
enum class HashCheck {
  // Every shard, hashed whole (streaming) when the checkpoint is opened, before any tensor is
  // read; and each chunk as it is read.
  Upfront,
  // The bytes a reader reads, chunk by chunk, before any of them is used (a shard of a
  // manifest without chunk digests, written by an older moecore: hashed whole, streaming, when
  // it is first opened): a rank hashes only what it reads.
  OnRead,
  None,
};

// The last chunk a shard reader read and verified: one buffer for all the shards of a
// CheckpointReader, however many it opens. Reads of neighbouring ranges (the runs of a slice,
// the tensors of one chunk) hit it instead of reading the chunk again.
struct ChunkCache {
  uint64_t shard = 0;  // the ShardReader's id; 0: empty
  uint64_t index = 0;
  std::vector<std::byte> bytes;
};

// Hashes the file whole, streaming through a bounded buffer, and checks the whole-file SHA-256
// and, when f has them, every chunk's against f. `where` (the checkpoint directory) and f.file
// name it in the error.
void verify_shard(const std::filesystem::path& path, const ShardFile& f, const std::string& where);

class ShardReader {
 public:
  // Opens `path`, whose manifest entry is f (its size checked), and reads and validates its
  // header (under OnRead, a shard without chunk digests is first hashed whole). `where` names
  // the checkpoint in errors; `cache` must outlive the reader.
  ShardReader(const std::filesystem::path& path, const ShardFile& f, HashCheck check,
              ChunkCache& cache, const std::string& where);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // Bytes [offset, offset + dst.size()) of tensor t's data (t from header()), verified.
  void read(const TensorInfo& t, uint64_t offset, std::span<std::byte> dst);
  // The bytes read from the file so far (whole chunks), for the tests of what a load reads.
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  // Bytes [offset, offset + dst.size()) of the file, through the verified chunks.
  void read_file(uint64_t offset, std::span<std::byte> dst);
  // Chunk `index` of the file, read and (with digests) verified, in the cache.
  const std::vector<std::byte>& chunk(uint64_t index);

  std::string path_, where_;
  ShardFile file_;
  bool verify_chunks_ = false;
  uint64_t chunk_bytes_ = 0;
  int fd_ = -1;
  uint64_t id_ = 0;
  ChunkCache& cache_;
  SafetensorsHeader header_;
  uint64_t bytes_read_ = 0;
};

}  // namespace moecore::ckpt
