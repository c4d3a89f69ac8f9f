// Helpers of the checkpoint tests: a fresh directory per test, whole-file reads and writes, a
// small checkpoint written as N ranks would write it, and the assertion that an error names what
// it should.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "ckpt/checkpoint_dir.h"
#include "common/testing.h"
#include "core/check.h"

namespace moecore::ckpt::testing {

using ::moecore::testing::error_of;

// <tmp>/moecore_ckpt.<pid>.<test>, emptied on entry and removed on exit.
class TempDir {
 public:
  TempDir() {
    const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() / ("moecore_ckpt." + std::to_string(::getpid()) +
                                                      "." + t->test_suite_name() + "." + t->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  // The names in the directory, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> v;
    for (const auto& e : std::filesystem::directory_iterator(path_)) {
      v.push_back(e.path().filename().string());
    }
    std::sort(v.begin(), v.end());
    return v;
  }

 private:
  std::filesystem::path path_;
};

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::vector<std::byte> read_bytes(const std::filesystem::path& p) {
  const std::string s = read_text(p);
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  return {b, b + s.size()};
}

inline void write_text(const std::filesystem::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
}

inline std::span<const std::byte> as_bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

template <typename T>
std::span<const std::byte> as_bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// One global tensor of a hand-written checkpoint: its whole value, row-major.
struct GlobalValues {
  std::string name, dtype;  // dtype: "F32", "I64", ...
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
  bool split = false;          // along dimension 0 over the ranks (shape[0] / ranks rows each),
                               // else whole in rank 0's shard
  std::string kind = "model";  // the shards it is in: model_rank_R or optim_rank_R
  // With split: flat pieces of the row-major elements instead of rows, ceil(n / ranks) each
  // (the last ones short or empty), as the distributed optimizer writes its moments.
  bool flat = false;

  template <typename T>
  static GlobalValues of(std::string name, const char* dtype, std::vector<int64_t> shape,
                         const std::vector<T>& v, bool split = false, std::string kind = "model") {
    const auto b = std::as_bytes(std::span<const T>(v));
    return {std::move(name), dtype, std::move(shape), {b.begin(), b.end()}, split, std::move(kind)};
  }
};

inline size_t dtype_size_of(const std::string& dtype) {
  return dtype == "F64" || dtype == "I64" ? 8 : dtype == "F32" || dtype == "I32" ? 4 : 2;
}

// Writes iteration `iteration` of `save` as `ranks` ranks of expert parallelism would: each
// rank's model and optim shards (those that hold a tensor) with their sizes and SHA-256, the
// validated manifest, the tracker. Returns the iteration directory.
inline std::filesystem::path write_checkpoint(const std::filesystem::path& save, int64_t iteration,
                                              int ranks, const std::vector<GlobalValues>& tensors) {
  const std::filesystem::path dir = iteration_dir(save, iteration);
  std::filesystem::create_directories(dir);
  Manifest m;
  m.iteration = iteration;
  m.world_size = ranks;
  m.layout = {{"ep", ranks}};
  for (const GlobalValues& t : tensors) m.tensors.push_back({t.name, t.dtype, t.shape, {}});
  for (int r = 0; r < ranks; ++r) {
    for (const char* kind : {"model", "optim"}) {
      SafetensorsWriter shard;
      const std::string file = shard_name(kind, r);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const GlobalValues& t = tensors[i];
        if (t.kind != kind || (!t.split && r > 0)) continue;
        if (!t.split) {
          shard.add(t.name, t.dtype, t.shape, t.bytes);
          m.tensors[i].slices.push_back({file});
          continue;
        }
        if (t.flat) {
          const size_t esize = dtype_size_of(t.dtype);
          const int64_t n = static_cast<int64_t>(t.bytes.size() / esize);
          const int64_t per = (n + ranks - 1) / ranks;
          const int64_t lo = std::min(n, r * per), len = std::min(n, lo + per) - lo;
          if (len == 0) continue;
          shard.add(t.name, t.dtype, {len},
                    std::span<const std::byte>(t.bytes).subspan(static_cast<size_t>(lo) * esize,
                                                                static_cast<size_t>(len) * esize));
          m.tensors[i].slices.push_back({file, SliceRef::kFlat, lo, len});
          continue;
        }
        const int64_t per = t.shape[0] / ranks;
        const size_t n = t.bytes.size() / static_cast<size_t>(ranks);
        std::vector<int64_t> shape = t.shape;
        shape[0] = per;
        shard.add(t.name, t.dtype, shape, std::span<const std::byte>(t.bytes).subspan(r * n, n));
        m.tensors[i].slices.push_back({file, 0, r * per, per});
      }
      if (shard.num_tensors() > 0) m.files.push_back(write_shard(dir, file, r, shard));
    }
  }
  write_manifest(dir, m);
  write_tracker(save, iteration);
  return dir;
}

}  // namespace moecore::ckpt::testing

#define EXPECT_ERROR_HAS(stmt, needle)                                            \
  do {                                                                            \
    const std::string msg_ = ::moecore::testing::error_of([&] { stmt; });   \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "error: '" << msg_ << "'"; \
  } while (0)
