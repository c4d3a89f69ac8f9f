// A read-only memory map of a data file. Opening checks everything that would make the file
// unable to serve (missing, a directory, a special file, unreadable, empty) and says so with the
// path and the flag that named it, instead of failing later inside a read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moecore::data {

class MappedFile {
 public:
  // what: how the path was given, for the messages (e.g. "--data-path prefix 'corpus': .idx").
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Why `path` cannot be read as a data file, or "" when it is a readable, non-empty regular
// file. Used for the messages above and to pick the kind of a --data-path entry.
std::string unreadable_reason(const std::string& path);
bool is_regular_file(const std::string& path);

}  // namespace moecore::data
