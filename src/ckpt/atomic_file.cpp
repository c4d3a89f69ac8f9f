#include "ckpt/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/check.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;

fs::path dir_of(const fs::path& path) {
  const fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// The fix for the errors a checkpoint write meets in practice; "" where errno says it all.
std::string hint(int err, const fs::path& path) {
  switch (err) {
    case ENOENT:
      return fmt::format(" (the directory '{}' does not exist: create it first)",
                         dir_of(path).string());
    case EACCES:
    case EPERM: return fmt::format(" (no permission to write in '{}')", dir_of(path).string());
    case EROFS: return " (the filesystem is mounted read-only)";
    case EISDIR: return " (a directory is in the way: remove or rename it)";
    case ENOSPC:
    case EDQUOT: return " (the disk or the quota is full: free space or save elsewhere)";
    default: return "";
  }
}

// A failed write leaves no temp behind: it would only be mistaken for a checkpoint file later.
// The unlink's own failure is not reported, the original error matters more.
// step: what failed, with "{}" where the temp's path goes.
[[noreturn]] void fail_temp(int fd, int err, std::string_view step, const fs::path& tmp,
                            const fs::path& path) {
  if (fd >= 0) ::close(fd);
  ::unlink(tmp.c_str());
  MOE_FAIL("[ckpt] cannot write '{}': {} failed: {}{}", path.string(),
           fmt::format(fmt::runtime(step), tmp.string()), std::strerror(err), hint(err, path));
}

// Test hook for the crash tests (tests/ckpt/test_atomic_file.cpp): with
// MOECORE_FAULT_KILL_AFTER_BYTES=N set, the process kills itself with SIGKILL once N bytes of the
// file it is writing are written (all of them when the file is shorter), before the fsync and the
// rename: what a crash in the middle of a write leaves behind. -1: not set.
int64_t fault_kill_after_bytes() {
  const char* v = std::getenv("MOECORE_FAULT_KILL_AFTER_BYTES");
  return v != nullptr && *v != '\0' ? std::atoll(v) : -1;
}

fs::path write_temp(const fs::path& path, const std::function<void(const ByteSink&)>& produce) {
  const int64_t kill_at = fault_kill_after_bytes();
  const fs::path tmp = temp_path_for(path);
  // O_TRUNC: a temp left by an earlier crash of this pid is overwritten, not appended to.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    MOE_FAIL("[ckpt] cannot write '{}': creating the temp '{}' failed: {}{}", path.string(),
             tmp.string(), std::strerror(err), hint(err, path));
  }
  uint64_t written = 0;
  const ByteSink sink = [&](std::span<const std::byte> piece) {
    const std::byte* p = piece.data();
    size_t left = piece.size();
    while (left > 0) {  // write() may write less than asked (signals, large sizes)
      size_t ask = left;
      if (kill_at >= 0) {
        if (written >= static_cast<uint64_t>(kill_at)) ::raise(SIGKILL);
        ask = std::min<uint64_t>(left, static_cast<uint64_t>(kill_at) - written);
      }
      const ssize_t n = ::write(fd, p, ask);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_temp(fd, errno, "writing the temp '{}'", tmp, path);
      }
      p += n;
      left -= static_cast<size_t>(n);
      written += static_cast<uint64_t>(n);
    }
  };
  try {
    produce(sink);
  } catch (...) {
    // The producer failed (a value could not be read): no temp is left behind.
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (kill_at >= 0) ::raise(SIGKILL);
  if (::fsync(fd) != 0) fail_temp(fd, errno, "fsync of the temp '{}'", tmp, path);
  // close() can report a deferred write error (NFS): it is checked like the writes.
  if (::close(fd) != 0) fail_temp(-1, errno, "closing the temp '{}'", tmp, path);
  return tmp;
}

fs::path write_temp(const fs::path& path, std::span<const std::span<const std::byte>> pieces) {
  return write_temp(path, [&](const ByteSink& sink) {
    for (const std::span<const std::byte> piece : pieces) sink(piece);
  });
}

void publish_temp(const fs::path& tmp, const fs::path& path) {
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    fail_temp(-1, errno, "renaming the temp '{}' over it", tmp, path);
  }
  // Without this the rename itself may not survive a crash: the target could come back old.
  fsync_dir(dir_of(path));
}

}  // namespace

fs::path temp_path_for(const fs::path& path) {
  fs::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid());
  return tmp;
}

void write_file_atomic(const fs::path& path, std::span<const std::span<const std::byte>> pieces) {
  publish_temp(write_temp(path, pieces), path);
}

void write_file_atomic_streamed(const fs::path& path,
                                const std::function<void(const ByteSink&)>& produce) {
  publish_temp(write_temp(path, produce), path);
}

void write_file_atomic(const fs::path& path, std::span<const std::byte> data) {
  const std::span<const std::byte> pieces[] = {data};
  write_file_atomic(path, pieces);
}

void write_file_atomic(const fs::path& path, std::string_view text) {
  write_file_atomic(path, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

fs::path write_temp_only(const fs::path& path, std::span<const std::byte> data) {
  const std::span<const std::byte> pieces[] = {data};
  return write_temp(path, pieces);
}

void fsync_file(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    MOE_FAIL("[ckpt] cannot fsync '{}': opening it failed: {}", path.string(), std::strerror(err));
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    MOE_FAIL("[ckpt] fsync of '{}' failed: {}: its content may not be on disk", path.string(),
             std::strerror(err));
  }
  ::close(fd);
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    MOE_FAIL("[ckpt] cannot fsync the directory '{}': opening it failed: {}", dir.string(),
             std::strerror(err));
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    MOE_FAIL(
        "[ckpt] fsync of the directory '{}' failed: {}: files just created or renamed in it "
        "may not survive a crash",
        dir.string(), std::strerror(err));
  }
  ::close(fd);
}

}  // namespace moecore::ckpt
