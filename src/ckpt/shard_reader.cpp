#include "ckpt/shard_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "ckpt/shard_digest.h"
#include "core/check.h"

namespace moecore::ckpt {
namespace {

// The chunk through which a shard without digests (or not checked) is read: a read of a few
// bytes reads this many.
constexpr uint64_t kPlainChunkBytes = uint64_t{1} << 20;

uint64_t next_reader_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// Reads exactly dst.size() bytes at `offset` of fd.
void pread_all(int fd, uint64_t offset, std::span<std::byte> dst, const std::string& path) {
  size_t got = 0;
  while (got < dst.size()) {
    const ssize_t n =
        ::pread(fd, dst.data() + got, dst.size() - got, static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      MOE_FAIL("[checkpoint] cannot read '{}': bytes [{}, {}): {}", path, offset,
               offset + dst.size(),
               n == 0 ? "the file shrank while being read" : std::strerror(err));
    }
    got += static_cast<size_t>(n);
  }
}

int open_regular(const std::string& path, uint64_t& size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    MOE_FAIL("[checkpoint] cannot open '{}': {}", path, std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_FAIL("[checkpoint] '{}' is not a regular file (a directory, device or pipe?)", path);
  }
  size = static_cast<uint64_t>(st.st_size);
  return fd;
}

}  // namespace

void verify_shard(const std::filesystem::path& path, const ShardFile& f, const std::string& where) {
  uint64_t size = 0;
  const int fd = open_regular(path.string(), size);
  try {
    MOE_CHECK(size == f.bytes,
              "[checkpoint] '{}': shard '{}' has {} bytes, the manifest recorded {}: the file "
              "was truncated or replaced",
              where, f.file, size, f.bytes);
    // With chunk digests, hashed in the manifest's chunks; without, in any.
    ShardDigester d(f.chunk_bytes > 0 ? f.chunk_bytes : kPlainChunkBytes);
    std::vector<std::byte> buf(static_cast<size_t>(std::min<uint64_t>(kPlainChunkBytes, size)));
    for (uint64_t at = 0; at < size; at += buf.size()) {
      const std::span<std::byte> piece(
          buf.data(), static_cast<size_t>(std::min<uint64_t>(buf.size(), size - at)));
      pread_all(fd, at, piece, path.string());
      d.update(piece);
    }
    ShardFile got;
    d.finish(got);
    MOE_CHECK(got.sha256 == f.sha256,
              "[checkpoint] '{}': shard '{}' has SHA-256 {}, the manifest recorded {}: the file "
              "was altered after the save",
              where, f.file, got.sha256, f.sha256);
    for (size_t c = 0; c < f.chunk_sha256.size(); ++c) {
      MOE_CHECK(got.chunk_sha256[c] == f.chunk_sha256[c],
                "[checkpoint] '{}': shard '{}' has SHA-256 {} in bytes [{}, {}) (chunk {} of {}), "
                "the manifest recorded {}: the manifest was altered",
                where, f.file, got.chunk_sha256[c], c * f.chunk_bytes,
                std::min(f.bytes, (c + 1) * f.chunk_bytes), c, f.chunk_sha256.size(),
                f.chunk_sha256[c]);
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

ShardReader::ShardReader(const std::filesystem::path& path, const ShardFile& f, HashCheck check,
                         ChunkCache& cache, const std::string& where)
    : path_(path.string()), where_(where), file_(f), id_(next_reader_id()), cache_(cache) {
  if (check == HashCheck::OnRead && f.chunk_bytes == 0) verify_shard(path, f, where);
  verify_chunks_ = check != HashCheck::None && f.chunk_bytes > 0;
  chunk_bytes_ = f.chunk_bytes > 0 ? f.chunk_bytes : kPlainChunkBytes;
  uint64_t size = 0;
  fd_ = open_regular(path_, size);
  try {
    MOE_CHECK(size == f.bytes,
              "[checkpoint] '{}': shard '{}' has {} bytes, the manifest recorded {}: the file "
              "was truncated or replaced",
              where, f.file, size, f.bytes);
    std::byte first8[8] = {};
    if (size >= 8) read_file(0, first8);
    const uint64_t n = safetensors_header_length(
        path_, std::span<const std::byte>(first8, size >= 8 ? 8 : 0), size);
    std::string text(static_cast<size_t>(n), '\0');
    read_file(8, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
    header_ = parse_safetensors_header(path_, text, size);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

ShardReader::~ShardReader() {
  if (fd_ >= 0) ::close(fd_);
}

const std::vector<std::byte>& ShardReader::chunk(uint64_t index) {
  if (cache_.shard == id_ && cache_.index == index) return cache_.bytes;
  const uint64_t begin = index * chunk_bytes_;
  const uint64_t end = std::min(file_.bytes, begin + chunk_bytes_);
  cache_.shard = 0;  // invalid until verified
  cache_.bytes.resize(static_cast<size_t>(end - begin));
  pread_all(fd_, begin, cache_.bytes, path_);
  bytes_read_ += end - begin;
  if (verify_chunks_) {
    Sha256 h;
    h.update(cache_.bytes);
    const std::string sha = h.finish();
    MOE_CHECK(sha == file_.chunk_sha256[index],
              "[checkpoint] '{}': shard '{}' has SHA-256 {} in bytes [{}, {}) (chunk {} of {}), "
              "the manifest recorded {}: the file was altered after the save",
              where_, file_.file, sha, begin, end, index, file_.chunk_sha256.size(),
              file_.chunk_sha256[index]);
  }
  cache_.shard = id_;
  cache_.index = index;
  return cache_.bytes;
}

void ShardReader::read_file(uint64_t offset, std::span<std::byte> dst) {
  MOE_CHECK(offset <= file_.bytes && dst.size() <= file_.bytes - offset,
            "[checkpoint] '{}': bytes [{}, {}) of shard '{}' of {} bytes", where_, offset,
            offset + dst.size(), file_.file, file_.bytes);
  while (!dst.empty()) {
    const uint64_t index = offset / chunk_bytes_;
    const std::vector<std::byte>& c = chunk(index);
    const uint64_t at = offset - index * chunk_bytes_;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(dst.size(), c.size() - at));
    std::memcpy(dst.data(), c.data() + at, n);
    dst = dst.subspan(n);
    offset += n;
  }
}

void ShardReader::read(const TensorInfo& t, uint64_t offset, std::span<std::byte> dst) {
  MOE_CHECK(offset <= t.nbytes && dst.size() <= t.nbytes - offset,
            "[checkpoint] '{}': bytes [{}, {}) of a tensor of {} bytes in '{}'", where_, offset,
            offset + dst.size(), t.nbytes, file_.file);
  read_file(header_.data_start + t.offset + offset, dst);
}

}  // namespace moecore::ckpt
