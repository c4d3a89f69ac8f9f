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
  size_t num_tensors() const { return names_.size(); }
  // In the order of their offsets in the data block (ties, i.e. empty tensors at one offset,
  // in header order).
  const std::vector<std::string>& names() const { return names_; }
  bool has(std::string_view name) const { return infos_.find(name) != infos_.end(); }
  // A missing name throws, saying how many tensors the file has.
  const TensorInfo& info(std::string_view name) const;
  // The tensor's bytes, little-endian, row-major. Not necessarily aligned to the element size
  // (the format does not promise it): copy them out (memcpy), do not cast the pointer.
  std::span<const std::byte> bytes(std::string_view name) const;
  // The "__metadata__" entries; empty when the header has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::unique_ptr<std::byte[]> file_;
  size_t file_size_ = 0;
  size_t data_start_ = 0;  // 8 + header length
  std::vector<std::string> names_;
  std::map<std::string, TensorInfo, std::less<>> infos_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moecore::ckpt
