#include "convert/output_dir.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"
#include "convert/hf_weights.h"
#include "core/check.h"
#include "core/fault_injection.h"

namespace moecore::convert {

namespace fs = std::filesystem;

namespace {

// What of a checkpoint `dir` holds ("" when nothing): the first entry found, for the message.
std::string checkpoint_entry(const fs::path& dir) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool hf = name == "config.json" || name == kHfIndexFile ||
                    (name.size() > 12 && name.ends_with(".safetensors"));
    const bool moecore = name == ckpt::kTrackerFile || name == ckpt::kManifestFile ||
                         name.starts_with("iter_");
    if (hf) return fmt::format("'{}' (an HF checkpoint)", name);
    if (moecore) return fmt::format("'{}' (a moecore checkpoint)", name);
  }
  return {};
}

}  // namespace

void check_output_dir(const fs::path& out, const std::string& what, bool empty) {
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (fs::exists(st)) {
    MOE_CHECK(fs::is_directory(st),
              "[convert] --output '{}' is a file, not a directory: give a directory to create "
              "for {} (nothing is overwritten)",
              out.string(), what);
    const std::string found = checkpoint_entry(out);
    MOE_CHECK(found.empty(),
              "[convert] --output '{}' holds {} already: convert into a new or empty directory, "
              "or remove it (nothing is overwritten, and an HF and a moecore checkpoint never "
              "share a directory)",
              out.string(), found);
    if (empty) {
      fs::directory_iterator it(out, ec);
      MOE_CHECK(!ec && it == fs::directory_iterator(),
                "[convert] --output '{}' is a directory that is not empty ('{}'): {} is "
                "published whole, by renaming it into place, which only an absent path or an "
                "empty directory allows; give a new or empty directory",
                out.string(), ec ? ec.message() : it->path().filename().string(), what);
    }
    MOE_CHECK(::access(out.c_str(), W_OK) == 0, "[convert] --output '{}' cannot be written: {}",
              out.string(), std::strerror(errno));
    return;
  }
  // The nearest existing ancestor must be a directory we may create entries in.
  fs::path p = fs::absolute(out, ec).lexically_normal();
  while (p.has_parent_path() && p != p.parent_path() && !fs::exists(p, ec)) p = p.parent_path();
  MOE_CHECK(fs::is_directory(p, ec),
            "[convert] --output '{}' cannot be created: '{}' is a file, not a directory",
            out.string(), p.string());
  MOE_CHECK(::access(p.c_str(), W_OK) == 0,
            "[convert] --output '{}' cannot be created: '{}': {}", out.string(), p.string(),
            std::strerror(errno));
}

void create_output_dir(const fs::path& out) {
  std::error_code ec;
  fs::create_directories(out, ec);
  MOE_CHECK(!ec, "[convert] --output '{}' cannot be created: {}", out.string(), ec.message());
  // Writable: a directory we may list may still refuse new files (a read-only mount).
  const fs::path probe = out / fmt::format(".moecore_write_probe.{}", ::getpid());
  errno = 0;
  bool ok = false;
  {
    std::ofstream f(probe);
    ok = f.good() && (f << "x").good();
  }
  const int err = errno;
  fs::remove(probe, ec);
  MOE_CHECK(ok, "[convert] --output '{}' cannot be written: {}", out.string(),
            std::strerror(err != 0 ? err : EIO));
}

fs::path StagedOutput::staging_path(const fs::path& out) {
  fs::path p = fs::absolute(out).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // "dir/" names dir
  std::string name = ".";  // appended, not "." + ...: GCC 12 warns (-Wrestrict) on operator+ here
  name += p.filename().string();
  name += ".partial";
  return p.parent_path() / name;
}

StagedOutput::StagedOutput(const fs::path& out) : out_(out), staging_(staging_path(out)) {
  std::error_code ec;
  // What an export killed before its rename left behind: never published, so nobody reads it.
  fs::remove_all(staging_, ec);
  MOE_CHECK(!ec, "[convert] cannot remove '{}', the unfinished output of an earlier conversion: {}",
            staging_.string(), ec.message());
  fs::create_directories(staging_.parent_path(), ec);
  MOE_CHECK(!ec, "[convert] --output '{}' cannot be created: {}", out.string(), ec.message());
  create_output_dir(staging_);
}

StagedOutput::~StagedOutput() {
  if (published_) return;
  std::error_code ec;
  fs::remove_all(staging_, ec);  // an error is unwinding: nothing more to report
}

void StagedOutput::publish() {
  // Every file was written through a temp, fsynced and renamed; the staging directory's own
  // entries are made durable before it becomes `out`, and `out`'s entry after.
  ckpt::fsync_dir(staging_);
  convert_fault_point("export.before_publish");
  MOE_CHECK(::rename(staging_.c_str(), out_.c_str()) == 0,
            "[convert] cannot rename '{}' to --output '{}': {} (nothing was published)",
            staging_.string(), out_.string(), std::strerror(errno));
  published_ = true;
  ckpt::fsync_dir(staging_.parent_path());
}

void convert_fault_point(std::string_view point) {
  fault::kill_point(point);
  for (const fault::Fault& f : fault::injected()) {
    MOE_CHECK(!(f.kind == "convert_error" && f.arg("at") == point),
              "[convert] write failed at {} (injected: MOECORE_FAULT convert_error)", point);
  }
}

}  // namespace moecore::convert
