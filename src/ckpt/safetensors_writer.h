// Builds one safetensors file from named tensors: checks each tensor as it is added (unique
// name, byte count = numel * dtype size), so an inconsistent shard is refused before anything
// reaches the disk. The output is deterministic: tensors in insertion order, metadata by key.
// The file is streamed: the header (known from the tensors' sizes alone), then each tensor's
// bytes, from a copy the writer holds or read from where the values live at write time through
// a bounded buffer, so writing a shard never holds a second copy of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"

namespace moecore::ckpt {

class SafetensorsWriter {
 public:
  // Fills dst with bytes [offset, offset + dst.size()) of a tensor (little-endian, row-major).
  using Source = std::function<void(uint64_t offset, std::span<std::byte> dst)>;
  // The most bytes a Source is asked for at once: the streaming buffer.
  static constexpr size_t kStreamBuffer = size_t{1} << 20;

  // Copies `bytes` (little-endian, row-major, as the format stores them). dtype is a
  // safetensors dtype string ("F32", "BF16", "I64", ...); shape [] is a scalar.
  void add(std::string name, std::string dtype, std::vector<int64_t> shape,
           std::span<const std::byte> bytes);
  // A buffer of the tensor's size that the writer holds, for the caller to fill before the file
  // is written (a copy of values that change meanwhile: an --async-save).
  std::span<std::byte> add_buffer(std::string name, std::string dtype, std::vector<int64_t> shape);
  // The tensor's bytes are read from `source` while the file is written (values that stay put
  // until then: a save the step waits for), at most kStreamBuffer bytes at a time.
  void add_source(std::string name, std::string dtype, std::vector<int64_t> shape, Source source);
  // "__metadata__" entry `key`: value (a later call with the same key replaces the value).
  void set_metadata(std::string key, std::string value);

  size_t num_tensors() const { return tensors_.size(); }
  // The JSON header, padded with spaces to a multiple of 8 bytes (as the reference writer
  // does, so the data block starts 8-aligned): the N bytes after the length.
  std::string header() const;
  // The file's size: 8 + the header + the data block.
  uint64_t file_bytes() const;
  // The whole file, in order, to `sink`: the length and header, then each tensor's bytes (held
  // ones in one piece, sourced ones in pieces of at most kStreamBuffer bytes).
  void stream(const ByteSink& sink) const;
  // The whole file in memory (tests, small files).
  std::vector<std::byte> serialize() const;
  // Writes the file with write_file_atomic_streamed (temp, fsync, rename, directory fsync).
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;        // in the data block
    std::unique_ptr<std::byte[]> held;  // the bytes, or null: read from `source`
    Source source;
  };
  // Checks the entry and appends it; returns it.
  Entry& append(std::string name, std::string dtype, std::vector<int64_t> shape, uint64_t nbytes);
  std::vector<Entry> tensors_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_bytes_ = 0;
};

}  // namespace moecore::ckpt
