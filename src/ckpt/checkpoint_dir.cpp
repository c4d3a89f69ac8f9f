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
#include "ckpt/shard_digest.h"
#include "ckpt/slice_geometry.h"
#include "core/check.h"
#include "core/fault_injection.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;

// std::filesystem's throwing overloads would escape as filesystem_error: every query and change
// here takes an error_code and fails as moecore::Error naming the path and the reason.
fs::file_type type_of(const fs::path& p) {
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  MOE_CHECK(!ec || st.type() == fs::file_type::not_found, "[checkpoint] cannot read '{}': {}",
            p.string(), ec.message());
  return st.type();
}

bool present(const fs::path& p) { return type_of(p) != fs::file_type::not_found; }

std::string type_name(fs::file_type t) {
  switch (t) {
    case fs::file_type::directory: return "a directory";
    case fs::file_type::regular: return "a file";
    case fs::file_type::not_found: return "missing";
    default: return "not a regular file";
  }
}

void rename_path(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  MOE_CHECK(!ec, "[checkpoint] cannot rename '{}' to '{}': {}", from.string(), to.string(),
            ec.message());
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  MOE_CHECK(!ec, "[checkpoint] cannot remove '{}': {}", p.string(), ec.message());
}

// The content of a regular file (the caller has checked that it is one).
std::string read_whole(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  MOE_CHECK(in.good(), "[checkpoint] cannot read '{}': {}", p.string(), std::strerror(errno));
  std::string s{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  MOE_CHECK(!in.bad(), "[checkpoint] cannot read '{}': {}", p.string(), std::strerror(errno));
  return s;
}

// Whether `dir` holds a complete checkpoint of `iteration`: its manifest valid and every shard
// there with the recorded size. The hashes are not read (recovery stays cheap on a large
// checkpoint): a kill cannot alter a file that was fsynced before the manifest was written.
bool is_complete(const fs::path& dir, int64_t iteration) {
  try {
    const CheckpointReader r(dir, HashCheck::None);
    return r.manifest().iteration == iteration;
  } catch (const Error&) {
    return false;
  }
}

// The directories a save of some iteration leaves besides iter_NNNNNNN: its staging dir, and the
// earlier copy a re-save moves aside (also "iter_NNNNNNN.replaced.<pid>", the name that earlier
// versions of moecore gave it).
struct Debris {
  bool staging = false;
  std::vector<fs::path> asides;  // replaced_dir first
};

// Parses "iter_<digits><suffix>"; false when `name` is not of that form.
bool parse_iteration_name(const std::string& name, int64_t& iteration, std::string& suffix) {
  if (name.rfind("iter_", 0) != 0) return false;
  size_t end = 5;
  while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
  if (end == 5 || end - 5 > 18) return false;
  iteration = std::stoll(name.substr(5, end - 5));
  suffix = name.substr(end);
  return true;
}

std::map<int64_t, Debris> find_debris(const fs::path& save) {
  std::map<int64_t, Debris> out;
  std::error_code ec;
  fs::directory_iterator it(save, ec);
  MOE_CHECK(!ec, "[checkpoint] cannot list '{}': {}", save.string(), ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int64_t iteration = 0;
    std::string suffix;
    if (!parse_iteration_name(name, iteration, suffix)) continue;
    if (type_of(it->path()) != fs::file_type::directory) continue;
    const std::string old_aside = ".replaced.";
    if (suffix == ".partial") {
      out[iteration].staging = true;
    } else if (suffix == ".replaced") {
      auto& a = out[iteration].asides;
      a.insert(a.begin(), it->path());
    } else if (suffix.rfind(old_aside, 0) == 0 && suffix.size() > old_aside.size() &&
               std::all_of(suffix.begin() + old_aside.size(), suffix.end(),
                           [](char c) { return c >= '0' && c <= '9'; })) {
      out[iteration].asides.push_back(it->path());
    }
  }
  MOE_CHECK(!ec, "[checkpoint] cannot list '{}': {}", save.string(), ec.message());
  return out;
}

std::string names_of(const std::vector<fs::path>& paths) {
  std::string s;
  for (const fs::path& p : paths) s += (s.empty() ? "" : ", ") + p.filename().string();
  return s;
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

fs::path replaced_dir(const fs::path& save, int64_t iteration) {
  fs::path p = iteration_dir(save, iteration);
  p += ".replaced";
  return p;
}

fs::path find_iteration_dir(const fs::path& save, int64_t iteration) {
  const fs::path dir = iteration_dir(save, iteration);
  if (present(dir / kManifestFile)) return dir;
  const fs::path aside = replaced_dir(save, iteration);
  return present(aside / kManifestFile) ? aside : dir;
}

fs::path begin_staging(const fs::path& save, int64_t iteration) {
  std::error_code ec;
  fs::create_directories(save, ec);
  MOE_CHECK(!ec, "[checkpoint] cannot create the --save directory '{}': {}", save.string(),
            ec.message());
  const fs::path staging = staging_dir(save, iteration);
  remove_tree(staging);
  fs::create_directory(staging, ec);
  MOE_CHECK(!ec, "[checkpoint] cannot create '{}': {}", staging.string(), ec.message());
  fsync_dir(save);
  save_kill_point("save.after_staging", 0);
  return staging;
}

void publish_iteration_dir(const fs::path& save, int64_t iteration) {
  const fs::path staging = staging_dir(save, iteration);
  const fs::path dir = iteration_dir(save, iteration);
  const fs::path aside = replaced_dir(save, iteration);
  MOE_CHECK(type_of(staging / kManifestFile) == fs::file_type::regular,
            "[checkpoint] '{}' has no {}: only a finished save is published", staging.string(),
            kManifestFile);
  const fs::file_type t = type_of(dir);
  MOE_CHECK(t == fs::file_type::not_found || t == fs::file_type::directory,
            "[checkpoint] '{}' is {}, not a checkpoint directory, in the way of the save of "
            "iteration {}: remove or rename it",
            dir.string(), type_name(t), iteration);
  if (t == fs::file_type::directory) {  // a re-save: the earlier copy stays readable aside
    if (present(aside)) {
      // Left by an interrupted re-save whose new copy is in `dir`; removed only when that copy
      // is whole, never as the last copy of the iteration.
      MOE_CHECK(is_complete(dir, iteration),
                "[checkpoint] '{}' and '{}' both exist and the first is not a complete "
                "checkpoint: keep whichever is complete as '{}' and remove the other",
                dir.string(), aside.string(), dir.filename().string());
      remove_tree(aside);
    }
    save_kill_point("publish.before_rename_aside", 0);
    rename_path(dir, aside);
    save_kill_point("publish.after_rename_aside", 0);
    fsync_dir(save);
    save_kill_point("publish.after_fsync_aside", 0);
  }
  save_kill_point("publish.before_rename", 0);
  rename_path(staging, dir);
  save_kill_point("publish.after_rename", 0);
  fsync_dir(save);
  save_kill_point("publish.after_fsync", 0);
  if (present(aside)) {
    // No fsync needed: an aside copy beside a complete `dir` is removed by recovery.
    remove_tree(aside);
    save_kill_point("publish.after_remove_aside", 0);
  }
}

void save_kill_point(std::string_view name, int rank) {
  MOE_CHECK(std::any_of(std::begin(kSaveKillPoints), std::end(kSaveKillPoints),
                        [&](const SaveKillPoint& p) { return p.name == name; }),
            "[checkpoint] kill point '{}' is not in kSaveKillPoints", name);
  fault::kill_point(name, rank);
}

std::string recover_checkpoint_dir(const fs::path& save) {
  if (type_of(save) != fs::file_type::directory) return "";
  std::vector<std::string> did;
  for (auto& [iteration, debris] : find_debris(save)) {
    const fs::path dir = iteration_dir(save, iteration);
    const fs::path staging = staging_dir(save, iteration);
    if (debris.staging) {
      if (is_complete(staging, iteration)) {
        // Finished (its manifest is written after every shard is durable): the publication
        // it was killed in is completed, the earlier copy moved aside if there is one.
        const bool aside = present(replaced_dir(save, iteration));
        publish_iteration_dir(save, iteration);
        did.push_back(fmt::format("published the finished save {} as {}{}",
                                  staging.filename().string(), dir.filename().string(),
                                  aside ? " (its earlier copy, moved aside, removed)" : ""));
      } else {
        remove_tree(staging);
        did.push_back(fmt::format("removed the unfinished save {}", staging.filename().string()));
      }
    }
    std::vector<fs::path> asides;
    for (const fs::path& a : debris.asides) {
      if (present(a)) asides.push_back(a);
    }
    if (asides.empty()) continue;
    if (!present(dir)) {
      // Killed between the two renames of a re-save whose new copy was not finished: the
      // earlier copy goes back.
      const auto whole = std::find_if(asides.begin(), asides.end(),
                                      [&](const fs::path& a) { return is_complete(a, iteration); });
      if (whole == asides.end()) {
        did.push_back(fmt::format("left {}: no complete copy of iteration {} among them",
                                  names_of(asides), iteration));
        continue;
      }
      rename_path(*whole, dir);
      fsync_dir(save);
      did.push_back(fmt::format("restored {} from {}", dir.filename().string(),
                                whole->filename().string()));
      asides.erase(whole);
    }
    if (asides.empty()) continue;
    if (is_complete(dir, iteration)) {
      for (const fs::path& a : asides) remove_tree(a);
      did.push_back(fmt::format("removed {} (earlier copies of iteration {}; {} is complete)",
                                names_of(asides), iteration, dir.filename().string()));
    } else {
      did.push_back(fmt::format("left {} as they are: {} is not a complete checkpoint",
                                names_of(asides), dir.filename().string()));
    }
  }
  std::string out;
  for (const std::string& d : did) out += (out.empty() ? "" : "; ") + d;
  return out;
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
  const fs::file_type t = type_of(p);
  if (t == fs::file_type::not_found) return std::nullopt;
  MOE_CHECK(t == fs::file_type::regular,
            "[checkpoint] '{}' is {}, not the tracker (a text file holding the latest "
            "iteration): remove it, or give another directory",
            p.string(), type_name(t));
  std::string s = read_whole(p);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  MOE_CHECK(!s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](char c) {
              return c >= '0' && c <= '9';
            }),
            "[checkpoint] '{}' holds '{}', not an iteration number: restore it or delete it to "
            "start afresh",
            p.string(), s.substr(0, 40));
  const int64_t iteration = std::stoll(s);
  const fs::path manifest = find_iteration_dir(save, iteration) / kManifestFile;
  if (!present(manifest)) {
    // A crash may have left the iteration's complete copies under other names.
    std::vector<fs::path> copies;
    const std::map<int64_t, Debris> debris = find_debris(save);
    if (const auto d = debris.find(iteration); d != debris.end()) {
      std::vector<fs::path> candidates = d->second.asides;
      if (d->second.staging) candidates.push_back(staging_dir(save, iteration));
      for (const fs::path& c : candidates) {
        if (is_complete(c, iteration)) copies.push_back(c);
      }
    }
    MOE_CHECK(copies.empty(),
              "[checkpoint] '{}' names iteration {}, but '{}' does not exist; complete copies "
              "of it left by an interrupted save: {}: a `moecore train` with --load or --save "
              "'{}' recovers them (or `moecore checkpoint recover {}`)",
              p.string(), iteration, manifest.string(), names_of(copies), save.string(),
              save.string());
    MOE_FAIL("[checkpoint] '{}' names iteration {}, but '{}' does not exist: the checkpoint was "
             "moved or deleted",
             p.string(), iteration, manifest.string());
  }
  return iteration;
}

ShardFile write_shard(const fs::path& dir, const std::string& file, int rank,
                      const SafetensorsWriter& shard, uint64_t chunk_bytes) {
  const uint64_t size = shard.file_bytes();
  ShardDigester digests(chunk_bytes > 0 ? chunk_bytes : chunk_bytes_for(size));
  write_file_atomic_streamed(dir / file, [&](const ByteSink& sink) {
    shard.stream([&](std::span<const std::byte> piece) {
      digests.update(piece);
      sink(piece);
    });
  });
  ShardFile f;
  f.file = file;
  f.rank = rank;
  digests.finish(f);
  MOE_CHECK(f.bytes == size, "[checkpoint] '{}': {} bytes written, the header promised {}",
            (dir / file).string(), f.bytes, size);
  return f;
}

void write_manifest(const fs::path& dir, const Manifest& m) {
  validate_manifest(m, (dir / kManifestFile).string());
  write_file_atomic(dir / kManifestFile, m.to_json_text());
}

CheckpointReader::CheckpointReader(const fs::path& dir, HashCheck hashes)
    : dir_(dir), hashes_(hashes) {
  const fs::file_type dt = type_of(dir);
  MOE_CHECK(dt == fs::file_type::directory || dt == fs::file_type::not_found,
            "[checkpoint] '{}' is {}, not a checkpoint directory", dir.string(), type_name(dt));
  const fs::path mp = dir / kManifestFile;
  const fs::file_type mt = type_of(mp);
  MOE_CHECK(mt != fs::file_type::not_found,
            "[checkpoint] '{}' is not a complete checkpoint: it has no {} (an interrupted save "
            "leaves none; load the iteration the tracker names)",
            dir.string(), kManifestFile);
  MOE_CHECK(mt == fs::file_type::regular, "[checkpoint] '{}' is {}, not a manifest file",
            mp.string(), type_name(mt));
  manifest_ = parse_manifest(read_whole(mp), mp.string());
  for (const ShardFile& f : manifest_.files) {
    const fs::path p = dir / f.file;
    const fs::file_type t = type_of(p);
    MOE_CHECK(t != fs::file_type::not_found, "[checkpoint] '{}': shard '{}' (rank {}) is missing",
              dir.string(), f.file, f.rank);
    MOE_CHECK(t == fs::file_type::regular, "[checkpoint] '{}': shard '{}' (rank {}) is {}, not "
              "a file", dir.string(), f.file, f.rank, type_name(t));
    std::error_code ec;
    const uint64_t size = fs::file_size(p, ec);
    MOE_CHECK(!ec, "[checkpoint] cannot read '{}': {}", p.string(), ec.message());
    MOE_CHECK(size == f.bytes,
              "[checkpoint] '{}': shard '{}' has {} bytes, the manifest recorded {}: the file "
              "was truncated or replaced",
              dir.string(), f.file, size, f.bytes);
    if (hashes_ == HashCheck::Upfront) verify_shard(p, f, dir.string());
  }
  for (size_t i = 0; i < manifest_.tensors.size(); ++i)
    tensor_index_.emplace(manifest_.tensors[i].name, i);
  for (size_t i = 0; i < manifest_.files.size(); ++i)
    file_index_.emplace(manifest_.files[i].file, i);
}

const GlobalTensor& CheckpointReader::tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  MOE_CHECK(it != tensor_index_.end(), "[checkpoint] '{}' has no tensor '{}' ({} tensors)",
            dir_.string(), name, manifest_.tensors.size());
  return manifest_.tensors[it->second];
}

ShardReader& CheckpointReader::shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it == shards_.end()) {
    const auto f = file_index_.find(file);
    MOE_CHECK(f != file_index_.end(), "[checkpoint] '{}': shard '{}' is not in the manifest",
              dir_.string(), file);
    it = shards_
             .emplace(file, std::make_unique<ShardReader>(dir_ / file, manifest_.files[f->second],
                                                          hashes_, cache_, dir_.string()))
             .first;
  }
  return *it->second;
}

std::vector<std::string> CheckpointReader::opened() const {
  std::vector<std::string> out;
  for (const auto& [file, r] : shards_) out.push_back(file);
  return out;
}

uint64_t CheckpointReader::bytes_read() const {
  uint64_t n = 0;
  for (const auto& [file, r] : shards_) n += r->bytes_read();
  return n;
}

void CheckpointReader::read(std::string_view name, std::string_view dtype, int dim,
                            int64_t offset, int64_t length, std::span<std::byte> dst) {
  const GlobalTensor& t = tensor(name);
  if (dim < 0 || (t.shape.empty() && dim == 0 && offset == 0 && length == 1)) {
    read(name, dtype, SliceRef{}, dst);  // the whole tensor (a scalar's one index)
    return;
  }
  const std::vector<int64_t> shape = t.shape.empty() ? std::vector<int64_t>{1} : t.shape;
  MOE_CHECK(static_cast<size_t>(dim) < shape.size() && offset >= 0 && length >= 0 &&
                offset <= shape[dim] && length <= shape[dim] - offset,
            "[checkpoint] '{}': tensor '{}' {} has no range [{}, {}) along dimension {}",
            dir_.string(), name, format_shape(t.shape), offset, offset + length, dim);
  read(name, dtype, SliceRef{"", dim, offset, length}, dst);
}

void CheckpointReader::read_flat(std::string_view name, std::string_view dtype, int64_t offset,
                                 int64_t length, std::span<std::byte> dst) {
  read(name, dtype, SliceRef{"", SliceRef::kFlat, offset, length}, dst);
}

void CheckpointReader::read(std::string_view name, std::string_view dtype, const SliceRef& want,
                            std::span<std::byte> dst) {
  const GlobalTensor& t = tensor(name);
  MOE_CHECK(dtype == t.dtype, "[checkpoint] '{}': tensor '{}' is {}, asked for as {}",
            dir_.string(), name, t.dtype, dtype);
  const size_t esize = dtype_size(t.dtype);
  const int64_t numel = t.numel();
  int64_t want_numel = 0;
  if (want.flat()) {
    MOE_CHECK(want.offset >= 0 && want.length >= 0 && want.offset <= numel &&
                  want.length <= numel - want.offset,
              "[checkpoint] '{}': tensor '{}' {} has no elements [{}, {})", dir_.string(), name,
              format_shape(t.shape), want.offset, want.offset + want.length);
    want_numel = want.length;
    MOE_CHECK(dst.size() == static_cast<size_t>(want_numel) * esize,
              "[checkpoint] '{}': tensor '{}' elements [{}, {}) are {} bytes, the destination {}",
              dir_.string(), name, want.offset, want.offset + want.length,
              static_cast<size_t>(want_numel) * esize, dst.size());
  } else {
    // The asked slice in bounds.
    if (!want.whole()) {
      for (int k = 0; k < 2; ++k) {
        const SliceDim d = k == 0 ? want.first() : want.second;
        if (!d.split()) continue;
        const int nd = static_cast<int>(t.shape.size());
        MOE_CHECK(d.dim < nd && d.parts >= 1 && t.shape[d.dim] % d.parts == 0 && d.offset >= 0 &&
                      d.length >= 0 && d.offset <= t.shape[d.dim] / d.parts &&
                      d.length <= t.shape[d.dim] / d.parts - d.offset &&
                      (k == 0 || d.dim > want.dim),
                  "[checkpoint] '{}': tensor '{}' {} has no range [{}, {}) along dimension {}{}",
                  dir_.string(), name, format_shape(t.shape), d.offset, d.offset + d.length,
                  d.dim, d.parts > 1 ? fmt::format(" in {} parts", d.parts) : "");
      }
    }
    want_numel = box_numel(want, t.shape);
    if (want.ranged()) {
      MOE_CHECK(want.range.offset >= 0 && want.range.length >= 0 &&
                    want.range.offset <= want_numel &&
                    want.range.length <= want_numel - want.range.offset,
                "[checkpoint] '{}': tensor '{}' {}: a slice of {} elements has no range [{}, {})",
                dir_.string(), name, format_shape(t.shape), want_numel, want.range.offset,
                want.range.offset + want.range.length);
      want_numel = want.range.length;
    }
    MOE_CHECK(dst.size() == static_cast<size_t>(want_numel) * esize,
              "[checkpoint] '{}': tensor '{}' {} is {} bytes, the destination {}", dir_.string(),
              name, want.whole() ? std::string("whole")
                                 : fmt::format("range [{}, {}) along dimension {}", want.offset,
                                               want.offset + want.length, want.dim),
              static_cast<size_t>(want_numel) * esize, dst.size());
  }
  int64_t copied = 0;
  for (const SliceRef& s : t.slices) {
    ShardReader* f = nullptr;  // opened at the first shared element
    const TensorInfo* info = nullptr;
    for_each_shared_run(t.shape, want, s, [&](int64_t w, int64_t h, int64_t n) {
      if (f == nullptr) {
        f = &shard(s.file);
        info = &f->header().info(f->path(), t.name);
        const std::vector<int64_t> stored = t.slice_shape(s);
        MOE_CHECK(info->dtype == t.dtype && info->shape == stored,
                  "[checkpoint] '{}': '{}' holds '{}' as {} {}, the manifest says {} {}",
                  dir_.string(), s.file, t.name, info->dtype, format_shape(info->shape), t.dtype,
                  format_shape(stored));
      }
      f->read(*info, static_cast<uint64_t>(h) * esize,
              dst.subspan(static_cast<size_t>(w) * esize, static_cast<size_t>(n) * esize));
      copied += n;
    });
  }
  // The stored slices hold every element once (validate_manifest): the count proves coverage.
  MOE_CHECK(copied == want_numel,
            "[checkpoint] '{}': tensor '{}': the slices cover {} of the {} elements asked for",
            dir_.string(), name, copied, want_numel);
}

}  // namespace moecore::ckpt
