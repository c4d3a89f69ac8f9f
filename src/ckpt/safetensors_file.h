// Reads one safetensors file and validates all of it before returning: the header length, the
// JSON, every tensor entry (dtype, shape, offsets = numel * dtype size) and that the tensors
// tile the data block exactly, without gaps, overlaps or trailing bytes. A corrupt or truncated
// checkpoint shard fails here, naming the file, the tensor and the numbers, never later as
// garbage weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/safetensors.h"

namespace moecore::ckpt {

// A file's header, validated: its tensors (dtype, shape, offsets = numel * dtype size, tiling
// the data block exactly) and metadata. What SafetensorsFile (a whole file in memory) and a
// checkpoint's shard reader (byte ranges read on demand) both check.
struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + header length: where the data block starts in the file
  // In the order of their offsets in the data block (ties, i.e. empty tensors at one offset,
  // in header order).
  std::vector<std::string> names;
  std::map<std::string, TensorInfo, std::less<>> infos;
  std::map<std::string, std::string> metadata;
  // A missing name throws naming `path` and how many tensors the file has.
  const TensorInfo& info(const std::string& path, std::string_view name) const;
};
// The header length a file of `file_size` bytes states in its first 8 bytes (`first8`; fewer
// when the file is shorter), checked against the file size and the reference's limit.
uint64_t safetensors_header_length(const std::string& path, std::span<const std::byte> first8,
                                   uint64_t file_size);
// Parses and validates the header text (the N bytes after the length) of a file of `file_size`
// bytes. Every error starts "[safetensors] '<path>': ".
SafetensorsHeader parse_safetensors_header(const std::string& path, std::string_view text,
                                           uint64_t file_size);

// A whole file read into memory.
struct FileBytes {
  std::unique_ptr<std::byte[]> data;
  size_t size = 0;
  std::span<const std::byte> span() const { return {data.get(), size}; }
};
// Throws naming the file when it cannot be opened or read, or is not a regular file.
FileBytes read_file_bytes(const std::filesystem::path& path);

class SafetensorsFile {
 public:
  // Reads the whole file into memory (a shard is one rank's slice, read once to load it).
  explicit SafetensorsFile(const std::filesystem::path& path);
  // The file's bytes, read already (to check a hash first); `path` names it in messages.
  SafetensorsFile(const std::filesystem::path& path, FileBytes bytes);

  const std::string& path() const { return path_; }
  size_t num_tensors() const { return header_.names.size(); }
  // In the order of their offsets in the data block (ties, i.e. empty tensors at one offset,
  // in header order).
  const std::vector<std::string>& names() const { return header_.names; }
  bool has(std::string_view name) const { return header_.infos.contains(name); }
  // A missing name throws, saying how many tensors the file has.
  const TensorInfo& info(std::string_view name) const;
  // The tensor's bytes, little-endian, row-major. Not necessarily aligned to the element size
  // (the format does not promise it): copy them out (memcpy), do not cast the pointer.
  std::span<const std::byte> bytes(std::string_view name) const;
  // The "__metadata__" entries; empty when the header has none.
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

 private:
  std::string path_;
  std::unique_ptr<std::byte[]> file_;
  size_t file_size_ = 0;
  SafetensorsHeader header_;
};

}  // namespace moecore::ckpt
