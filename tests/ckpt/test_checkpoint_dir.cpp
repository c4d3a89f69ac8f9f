// A checkpoint directory: the tracker names the latest complete checkpoint and survives a crash
// before its rename; shards and manifest written here read back, and any slice of a global
// tensor comes back from whatever slices the checkpoint stored (the resharding read: 2 -> 4,
// 4 -> 2, split -> whole, whole -> split); truncated, altered and missing shards and a missing
// manifest are refused before any tensor is read.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt_files.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::as_bytes;
using testing::TempDir;

// The global expert weight W [4, 3, 2] (4 experts) holds 0..23; bias B [5] holds 100..104.
std::vector<float> global_w() {
  std::vector<float> w(24);
  std::iota(w.begin(), w.end(), 0.0f);
  return w;
}
std::vector<float> experts(int64_t first, int64_t n) {
  const std::vector<float> w = global_w();
  return {w.begin() + first * 6, w.begin() + (first + n) * 6};
}

// Writes iteration `iter` with W split over `ranks` shards along the experts (each rank 4 /
// ranks experts), B and the scalar step S whole in rank 0's shard.
fs::path save(const TempDir& t, int ranks, int64_t iter = 10) {
  return testing::write_checkpoint(
      t.path(), iter, ranks,
      {testing::GlobalValues::of("w", "F32", {4, 3, 2}, global_w(), /*split=*/true),
       testing::GlobalValues::of("b", "F32", {5}, std::vector<float>{100, 101, 102, 103, 104}),
       testing::GlobalValues::of("s", "I64", {}, std::vector<int64_t>{42})});
}

template <typename T>
std::vector<T> read(CheckpointReader& r, const std::string& name, const char* dtype, int dim,
                    int64_t off, int64_t len, size_t n) {
  std::vector<T> out(n);
  r.read(name, dtype, dim, off, len, std::as_writable_bytes(std::span<T>(out)));
  return out;
}

TEST(CheckpointDir, NamesFollowMegatron) {
  EXPECT_EQ(iteration_dir("/s", 100), fs::path("/s/iter_0000100"));
  EXPECT_EQ(iteration_dir("/s", 123456789), fs::path("/s/iter_123456789"));
  EXPECT_EQ(shard_name("optim", 3), "optim_rank_00003.safetensors");
}

TEST(CheckpointDir, TrackerNamesTheLatestCompleteCheckpoint) {
  TempDir t;
  EXPECT_EQ(read_tracker(t.path()), std::nullopt);  // a fresh run
  save(t, 2, 10);
  EXPECT_EQ(read_tracker(t.path()), 10);
  EXPECT_EQ(testing::read_text(t / std::string(kTrackerFile)), "10\n");
  // A crash after writing the next tracker's temp, before its rename: still iteration 10.
  write_temp_only(t / std::string(kTrackerFile), as_bytes(std::string("20\n")));
  EXPECT_EQ(read_tracker(t.path()), 10);
  // A tracker naming a directory without a manifest (moved away, or never completed).
  write_tracker(t.path(), 30);
  EXPECT_ERROR_HAS(read_tracker(t.path()), "names iteration 30, but '");
  testing::write_text(t / std::string(kTrackerFile), "ten\n");
  EXPECT_ERROR_HAS(read_tracker(t.path()), "holds 'ten', not an iteration number");
}

TEST(CheckpointDir, ReadsEverySliceWhateverTheLayoutThatWroteIt) {
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "written by " << ranks << " ranks");
    TempDir t;
    CheckpointReader r(save(t, ranks));
    EXPECT_EQ(r.manifest().world_size, ranks);
    EXPECT_EQ(read<float>(r, "w", "F32", -1, 0, 0, 24), global_w());  // whole
    for (int want : {1, 2, 4}) {  // the slices of a layout of `want` EP ranks
      const int64_t per = 4 / want;
      for (int i = 0; i < want; ++i) {
        EXPECT_EQ(read<float>(r, "w", "F32", 0, i * per, per, per * 6), experts(i * per, per))
            << "rank " << i << " of " << want;
      }
    }
    EXPECT_EQ(read<float>(r, "w", "F32", 0, 1, 2, 12), experts(1, 2));  // straddles shards
    EXPECT_EQ(read<float>(r, "b", "F32", -1, 0, 0, 5),
              (std::vector<float>{100, 101, 102, 103, 104}));
    EXPECT_EQ(read<float>(r, "b", "F32", 0, 3, 2, 2), (std::vector<float>{103, 104}));
    EXPECT_EQ(read<int64_t>(r, "s", "I64", -1, 0, 0, 1), (std::vector<int64_t>{42}));
  }
}

// The distributed optimizer's moments: flat pieces of the row-major elements, cutting rows
// (W's 24 elements over 4 ranks: [0, 6), [6, 12), ...; over 5: [0, 5), [5, 10), ..., [20, 24)).
// Any read comes back whole, in rows or flat, and a flat read comes back from rows.
TEST(CheckpointDir, ReadsFlatSlicesAndReadsFlatRangesOfAnySlices) {
  auto flat_range = [](int64_t lo, int64_t n) {
    const std::vector<float> w = global_w();
    return std::vector<float>(w.begin() + lo, w.begin() + lo + n);
  };
  auto read_flat = [](CheckpointReader& r, int64_t lo, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    r.read_flat("w", "F32", lo, n, std::as_writable_bytes(std::span<float>(out)));
    return out;
  };
  for (int ranks : {1, 4, 5, 7}) {
    SCOPED_TRACE(::testing::Message() << "flat over " << ranks << " ranks");
    TempDir t;
    testing::GlobalValues w = testing::GlobalValues::of("w", "F32", {4, 3, 2}, global_w(), true);
    w.flat = true;
    CheckpointReader r(testing::write_checkpoint(t.path(), 10, ranks, {w}));
    EXPECT_EQ(r.tensor("w").slices.front().dim, SliceRef::kFlat);
    EXPECT_EQ(read<float>(r, "w", "F32", -1, 0, 0, 24), global_w());
    EXPECT_EQ(read<float>(r, "w", "F32", 0, 1, 2, 12), experts(1, 2));
    EXPECT_EQ(read_flat(r, 5, 9), flat_range(5, 9));  // straddles pieces
    EXPECT_EQ(read_flat(r, 23, 1), flat_range(23, 1));
    EXPECT_EQ(read_flat(r, 7, 0), flat_range(7, 0));
    std::vector<float> buf(8);  // [4, 1, 2]
    EXPECT_ERROR_HAS(r.read("w", "F32", 1, 0, 1, std::as_writable_bytes(std::span<float>(buf))),
                     "is stored in flat pieces, asked for along dimension 1");
  }
  TempDir t;
  CheckpointReader r(save(t, 2));  // rows: the experts [0, 2) and [2, 4)
  EXPECT_EQ(read_flat(r, 3, 17), flat_range(3, 17));
  std::vector<float> buf(8);
  const auto dst = std::as_writable_bytes(std::span<float>(buf));
  EXPECT_ERROR_HAS(r.read_flat("w", "F32", 20, 8, dst), "has no elements [20, 28)");
  EXPECT_ERROR_HAS(r.read_flat("w", "F32", 0, 4, dst), "elements [0, 4) are 16 bytes, the "
                   "destination 32");
}

TEST(CheckpointDir, RefusesReadsThatDoNotFit) {
  TempDir t;
  CheckpointReader r(save(t, 2));
  std::vector<float> buf(24);
  const auto dst = std::as_writable_bytes(std::span<float>(buf));
  EXPECT_ERROR_HAS(r.read("w", "BF16", -1, 0, 0, dst), "tensor 'w' is F32, asked for as BF16");
  EXPECT_ERROR_HAS(r.read("w", "F32", 0, 3, 2, dst), "has no range [3, 5) along dimension 0");
  EXPECT_ERROR_HAS(r.read("w", "F32", 0, 0, 2, dst), "is 48 bytes, the destination 96");
  EXPECT_ERROR_HAS(r.read("w", "F32", 1, 0, 3, dst.first(24 * 4)),
                   "stored split along dimension 0, asked for along dimension 1");
  EXPECT_ERROR_HAS(r.read("nope", "F32", -1, 0, 0, dst), "has no tensor 'nope' (3 tensors)");
}

TEST(CheckpointDir, RefusesAnIncompleteOrAlteredCheckpointBeforeReading) {
  {
    TempDir t;
    const fs::path dir = save(t, 2);
    fs::remove(dir / std::string(kManifestFile));
    EXPECT_ERROR_HAS(CheckpointReader r(dir), "is not a complete checkpoint: it has no manifest");
  }
  {
    TempDir t;
    const fs::path dir = save(t, 2);
    fs::remove(dir / shard_name("model", 1));
    EXPECT_ERROR_HAS(CheckpointReader r(dir),
                     "shard 'model_rank_00001.safetensors' (rank 1) is missing");
  }
  {
    TempDir t;
    const fs::path dir = save(t, 2);
    const fs::path p = dir / shard_name("model", 1);
    fs::resize_file(p, fs::file_size(p) - 4);
    EXPECT_ERROR_HAS(CheckpointReader r(dir), "the file was truncated or replaced");
  }
  {
    TempDir t;
    const fs::path dir = save(t, 2);
    const fs::path p = dir / shard_name("model", 0);
    std::string bytes = testing::read_text(p);
    bytes[bytes.size() - 3] ^= 0x40;  // one bit of a weight
    testing::write_text(p, bytes);
    EXPECT_ERROR_HAS(CheckpointReader r(dir), "the file was altered after the save");
    // Without the hash check it opens, and the altered shard is still a valid file.
    CheckpointReader unchecked(dir, HashCheck::None);
    std::vector<int64_t> s(1);
    unchecked.read("s", "I64", -1, 0, 0, std::as_writable_bytes(std::span<int64_t>(s)));
    EXPECT_NE(s[0], 42);
  }
}

// HashCheck::OnOpen: a shard's hash is checked when it is first needed, before any of its
// tensors is read, and even a header byte flipped is reported as an altered file, not parsed.
TEST(CheckpointDir, ChecksAShardsHashWhenItIsFirstOpened) {
  TempDir t;
  const fs::path dir = save(t, 2);
  const fs::path p = dir / shard_name("model", 1);
  std::string bytes = testing::read_text(p);
  bytes[9] ^= 0x01;  // inside the JSON header
  testing::write_text(p, bytes);
  CheckpointReader r(dir, HashCheck::OnOpen);  // sizes only so far
  std::vector<float> w(2 * 3 * 2);
  EXPECT_ERROR_HAS(r.read("w", "F32", 0, 2, 2, std::as_writable_bytes(std::span<float>(w))),
                   "shard 'model_rank_00001.safetensors' has SHA-256");
  // Rank 0's shard is intact and serves its slice.
  r.read("w", "F32", 0, 0, 2, std::as_writable_bytes(std::span<float>(w)));
  EXPECT_EQ(w, experts(0, 2));
}

// A shard that disagrees with the manifest about a tensor's shape is caught at the read.
TEST(CheckpointDir, RefusesAShardThatDisagreesWithTheManifest) {
  TempDir t;
  const fs::path dir = save(t, 2);
  SafetensorsWriter wrong;
  const std::vector<float> w = experts(2, 2);
  wrong.add("w", "F32", {2, 6}, as_bytes(w));
  Manifest m = CheckpointReader(dir).manifest();
  m.files[1] = write_shard(dir, shard_name("model", 1), 1, wrong);
  write_manifest(dir, m);
  CheckpointReader r(dir);
  std::vector<float> buf(24);
  EXPECT_ERROR_HAS(r.read("w", "F32", -1, 0, 0, std::as_writable_bytes(std::span<float>(buf))),
                   "holds 'w' as F32 [2, 6], the manifest says F32 [2, 3, 2]");
}

}  // namespace
}  // namespace moecore::ckpt
