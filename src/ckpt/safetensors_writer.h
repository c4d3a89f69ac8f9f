// Builds one safetensors file from named tensors: checks each tensor as it is added (unique
// name, byte count = numel * dtype size), so an inconsistent shard is refused before anything
// reaches the disk. The output is deterministic: tensors in insertion order, metadata by key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace moecore::ckpt {

class SafetensorsWriter {
 public:
  // Copies `bytes` (little-endian, row-major, as the format stores them). dtype is a
  // safetensors dtype string ("F32", "BF16", "I64", ...); shape [] is a scalar.
  void add(std::string name, std::string dtype, std::vector<int64_t> shape,
           std::span<const std::byte> bytes);
  // "__metadata__" entry `key`: value (a later call with the same key replaces the value).
  void set_metadata(std::string key, std::string value);

  size_t num_tensors() const { return tensors_.size(); }
  // The JSON header, padded with spaces to a multiple of 8 bytes (as the reference writer
  // does, so the data block starts 8-aligned): the N bytes after the length.
  std::string header() const;
  // The whole file: length, header, data block.
  std::vector<std::byte> serialize() const;
  // Writes the file with write_file_atomic (temp, fsync, rename, directory fsync).
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // in data_
  };
  std::vector<Entry> tensors_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::byte> data_;
};

}  // namespace moecore::ckpt
