#include "data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace moecore::data {

std::string unreadable_reason(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? "does not exist" : fmt::format("cannot be examined ({})", std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) return "is a directory";
  if (!S_ISREG(st.st_mode)) return "is not a regular file (a device, pipe or socket)";
  if (::access(path.c_str(), R_OK) != 0) return fmt::format("is not readable ({})", std::strerror(errno));
  if (st.st_size == 0) return "is empty";
  return "";
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path) {
  const std::string why = unreadable_reason(path);
  MOE_CHECK(why.empty(), "[data] {} '{}' {}", what, path, why);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOE_CHECK(fd >= 0, "[data] {} '{}' cannot be opened: {}", what, path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    MOE_FAIL("[data] {} '{}' is empty or cannot be examined", what, path);
  }
  size_ = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  MOE_CHECK(p != MAP_FAILED, "[data] {} '{}' cannot be memory-mapped: {}", what, path,
            std::strerror(err));
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace moecore::data
