#include "convert/output_dir.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"
#include "convert/hf_weights.h"
#include "core/check.h"

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

void check_output_dir(const fs::path& out, const std::string& what) {
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

}  // namespace moecore::convert
