#include "ckpt/checkpoint_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "ckpt/atomic_file.h"
#include "ckpt/safetensors.h"
#include "ckpt/sha256.h"
#include "core/check.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;

std::string read_whole(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  MOE_CHECK(in.good(), "[checkpoint] cannot read '{}'", p.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int64_t product(const std::vector<int64_t>& v, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= v[i];
  return p;
}

}  // namespace

fs::path iteration_dir(const fs::path& save, int64_t iteration) {
  MOE_CHECK(iteration >= 0, "[checkpoint] iteration {} < 0", iteration);
  return save / fmt::format("iter_{:07d}", iteration);
}

fs::path staging_dir(const fs::path& save, int64_t iteration) {
  fs::path p = iteration_dir(save, iteration);
  p += ".partial";
  return p;
}

void publish_iteration_dir(const fs::path& staging, const fs::path& dir) {
  MOE_CHECK(fs::exists(staging / kManifestFile),
            "[checkpoint] '{}' has no {}: only a complete save is published", staging.string(),
            kManifestFile);
  std::error_code ec;
  fs::path aside;
  if (fs::exists(dir)) {
    aside = dir;
    aside += fmt::format(".replaced.{}", ::getpid());
    fs::rename(dir, aside, ec);
    MOE_CHECK(!ec, "[checkpoint] cannot move the earlier '{}' aside to '{}': {}", dir.string(),
              aside.string(), ec.message());
  }
  fs::rename(staging, dir, ec);
  MOE_CHECK(!ec, "[checkpoint] cannot rename '{}' to '{}': {}", staging.string(), dir.string(),
            ec.message());
  fsync_dir(dir.parent_path());
  if (!aside.empty()) fs::remove_all(aside, ec);  // a leftover is harmless debris
}

std::string shard_name(std::string_view kind, int rank) {
  return fmt::format("{}_rank_{:05d}.safetensors", kind, rank);
}

void check_save_dir(const fs::path& save, const std::string& who) {
  // A file named like the directory is refused with the flags (CheckpointConfig::validate);
  // here it fails the probe ("Not a directory").
  std::error_code ec;
  if (!fs::exists(save, ec)) {
    fs::create_directories(save, ec);
    MOE_CHECK(!ec, "[checkpoint] --save '{}' cannot be created: {}: give a writable directory",
              save.string(), ec.message());
  }
  const fs::path probe = save / fmt::format(".moecore_write_probe.{}", who);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MOE_CHECK(fd >= 0, "[checkpoint] --save '{}' cannot be written: {}: give a writable directory",
            save.string(), std::strerror(errno));
  const bool ok = ::write(fd, "probe\n", 6) == 6 && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  fs::remove(probe, ec);
  MOE_CHECK(ok, "[checkpoint] --save '{}' cannot be written: {}: give a writable directory",
            save.string(), std::strerror(err));
}

void write_tracker(const fs::path& save, int64_t iteration) {
  write_file_atomic(save / kTrackerFile, std::to_string(iteration) + "\n");
}

std::optional<int64_t> read_tracker(const fs::path& save) {
  const fs::path p = save / kTrackerFile;
  if (!fs::exists(p)) return std::nullopt;
  std::string s = read_whole(p);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  MOE_CHECK(!s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](char c) {
              return c >= '0' && c <= '9';
            }),
            "[checkpoint] '{}' holds '{}', not an iteration number: restore it or delete it to "
            "start afresh",
            p.string(), s.substr(0, 40));
  const int64_t iteration = std::stoll(s);
  const fs::path manifest = iteration_dir(save, iteration) / kManifestFile;
  MOE_CHECK(fs::exists(manifest),
            "[checkpoint] '{}' names iteration {}, but '{}' does not exist: the checkpoint was "
            "moved or deleted",
            p.string(), iteration, manifest.string());
  return iteration;
}

ShardFile write_shard(const fs::path& dir, const std::string& file, int rank,
                      const SafetensorsWriter& shard) {
  const std::vector<std::byte> bytes = shard.serialize();
  write_file_atomic(dir / file, bytes);
  return ShardFile{file, rank, bytes.size(), sha256_hex(bytes)};
}

void write_manifest(const fs::path& dir, const Manifest& m) {
  validate_manifest(m, (dir / kManifestFile).string());
  write_file_atomic(dir / kManifestFile, m.to_json_text());
}

CheckpointReader::CheckpointReader(const fs::path& dir, HashCheck hashes)
    : dir_(dir), hashes_(hashes) {
  const fs::path mp = dir / kManifestFile;
  MOE_CHECK(fs::exists(mp),
            "[checkpoint] '{}' is not a complete checkpoint: it has no {} (an interrupted save "
            "leaves none; load the iteration the tracker names)",
            dir.string(), kManifestFile);
  manifest_ = parse_manifest(read_whole(mp), mp.string());
  for (const ShardFile& f : manifest_.files) {
    const fs::path p = dir / f.file;
    MOE_CHECK(fs::exists(p), "[checkpoint] '{}': shard '{}' (rank {}) is missing", dir.string(),
              f.file, f.rank);
    const uint64_t size = fs::file_size(p);
    MOE_CHECK(size == f.bytes,
              "[checkpoint] '{}': shard '{}' has {} bytes, the manifest recorded {}: the file "
              "was truncated or replaced",
              dir.string(), f.file, size, f.bytes);
    if (hashes_ == HashCheck::Upfront) check_hash(f, read_file_bytes(p).span());
  }
}

void CheckpointReader::check_hash(const ShardFile& f, std::span<const std::byte> bytes) const {
  const std::string sha = sha256_hex(bytes);
  MOE_CHECK(sha == f.sha256,
            "[checkpoint] '{}': shard '{}' has SHA-256 {}, the manifest recorded {}: the file "
            "was altered after the save",
            dir_.string(), f.file, sha, f.sha256);
}

const GlobalTensor& CheckpointReader::tensor(std::string_view name) const {
  const GlobalTensor* t = manifest_.find(name);
  MOE_CHECK(t != nullptr, "[checkpoint] '{}' has no tensor '{}' ({} tensors)", dir_.string(), name,
            manifest_.tensors.size());
  return *t;
}

SafetensorsFile& CheckpointReader::shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it == shards_.end()) {
    FileBytes bytes = read_file_bytes(dir_ / file);
    const ShardFile* f = manifest_.file(file);
    MOE_CHECK(f != nullptr && bytes.size == f->bytes,
              "[checkpoint] '{}': shard '{}' has {} bytes, the manifest recorded {}: the file "
              "was truncated or replaced",
              dir_.string(), file, bytes.size, f ? f->bytes : 0);
    if (hashes_ == HashCheck::OnOpen) check_hash(*f, bytes.span());
    it = shards_.emplace(file, std::make_unique<SafetensorsFile>(dir_ / file, std::move(bytes)))
             .first;
  }
  return *it->second;
}

void CheckpointReader::read(std::string_view name, std::string_view dtype, int dim,
                            int64_t offset, int64_t length, std::span<std::byte> dst) {
  const GlobalTensor& t = tensor(name);
  MOE_CHECK(dtype == t.dtype, "[checkpoint] '{}': tensor '{}' is {}, asked for as {}",
            dir_.string(), name, t.dtype, dtype);
  const size_t esize = dtype_size(t.dtype);
  const size_t ndim = t.shape.size();
  if (dim < 0) {  // the whole tensor: the range of all indices of dimension 0
    dim = 0;
    offset = 0;
    length = ndim > 0 ? t.shape[0] : 1;
  }
  const std::vector<int64_t> shape = ndim > 0 ? t.shape : std::vector<int64_t>{1};
  MOE_CHECK(static_cast<size_t>(dim) < shape.size() && offset >= 0 && length >= 0 &&
                offset + length <= shape[dim],
            "[checkpoint] '{}': tensor '{}' {} has no range [{}, {}) along dimension {}",
            dir_.string(), name, format_shape(t.shape), offset, offset + length, dim);
  const int64_t outer = product(shape, 0, dim);
  const size_t inner = static_cast<size_t>(product(shape, dim + 1, shape.size())) * esize;
  MOE_CHECK(dst.size() == static_cast<size_t>(outer * length) * inner,
            "[checkpoint] '{}': tensor '{}' range [{}, {}) along dimension {} is {} bytes, the "
            "destination {}",
            dir_.string(), name, offset, offset + length, dim, outer * length * inner, dst.size());
  int64_t copied = 0;
  for (const SliceRef& s : t.slices) {
    // A whole-tensor slice is the slice of every index of the asked dimension.
    const int64_t s_off = s.dim < 0 ? 0 : s.offset;
    const int64_t s_len = s.dim < 0 ? shape[dim] : s.length;
    MOE_CHECK(s.dim < 0 || s.dim == dim,
              "[checkpoint] '{}': tensor '{}' is stored split along dimension {}, asked for "
              "along dimension {}: resharding across dimensions is not supported yet",
              dir_.string(), name, s.dim, dim);
    const int64_t lo = std::max(offset, s_off), hi = std::min(offset + length, s_off + s_len);
    if (lo >= hi) continue;
    SafetensorsFile& f = shard(s.file);
    const TensorInfo& info = f.info(name);
    const std::vector<int64_t> want = t.slice_shape(s);
    MOE_CHECK(info.dtype == t.dtype && info.shape == want,
              "[checkpoint] '{}': '{}' holds '{}' as {} {}, the manifest says {} {}",
              dir_.string(), s.file, name, info.dtype, format_shape(info.shape), t.dtype,
              format_shape(want));
    const std::span<const std::byte> src = f.bytes(name);
    const size_t run = static_cast<size_t>(hi - lo) * inner;
    for (int64_t o = 0; o < outer; ++o) {
      std::memcpy(dst.data() + static_cast<size_t>(o * length + (lo - offset)) * inner,
                  src.data() + static_cast<size_t>(o * s_len + (lo - s_off)) * inner, run);
    }
    copied += hi - lo;
  }
  MOE_CHECK(copied == length,
            "[checkpoint] '{}': tensor '{}': the slices cover {} of the {} indices asked for",
            dir_.string(), name, copied, length);
}

}  // namespace moecore::ckpt
