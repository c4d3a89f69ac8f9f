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
#include "ckpt/shard_digest.h"
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

// W[:, first:first + n, :] (indices along dimension 1), row-major.
std::vector<float> columns(int64_t first, int64_t n) {
  const std::vector<float> w = global_w();
  std::vector<float> out;
  for (int64_t e = 0; e < 4; ++e) {
    for (int64_t j = first; j < first + n; ++j) {
      for (int64_t h = 0; h < 2; ++h) out.push_back(w[(e * 3 + j) * 2 + h]);
    }
  }
  return out;
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
    // Along another dimension from the flat pieces: W[:, 1:3, :].
    EXPECT_EQ(read<float>(r, "w", "F32", 1, 1, 2, 16), columns(1, 2));
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
  // Along another dimension than the stored slices': W[:, 1:3, :] from the experts' rows.
  EXPECT_EQ(read<float>(r, "w", "F32", 1, 1, 2, 16), columns(1, 2));
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

// HashCheck::OnRead: the bytes of a shard are checked when they are first needed, before any of
// its tensors is read, and even a header byte flipped is reported as an altered file, not parsed.
TEST(CheckpointDir, ChecksAShardsHashWhenItIsFirstOpened) {
  TempDir t;
  const fs::path dir = save(t, 2);
  const fs::path p = dir / shard_name("model", 1);
  std::string bytes = testing::read_text(p);
  bytes[9] ^= 0x01;  // inside the JSON header
  testing::write_text(p, bytes);
  CheckpointReader r(dir, HashCheck::OnRead);  // sizes only so far
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

namespace moecore::ckpt {
namespace {

// Tensor parallelism's slices. The global expert weight X [E = 4, 2F = 8, H = 3] (SwiGLU's
// [gate; up] rows) holds 0..95. A layout's slice of it: experts [e0, e0 + ne), and of each of the
// two halves of dimension 1 rows [f0, f0 + nf) (parts 2).
struct Parted {
  int64_t e0, ne, f0, nf;
  SliceRef ref(std::string file = {}) const {
    if (nf == 4) return ne == 4 ? SliceRef{std::move(file)} : SliceRef{std::move(file), 0, e0, ne};
    if (ne == 4) return {std::move(file), 1, f0, nf, 2};  // ETP only
    return {std::move(file), 0, e0, ne, 1, SliceDim{1, f0, nf, 2}};
  }
  // The slice's values as a rank holds them (row-major [ne, 2 nf, 3]), by plain loops.
  std::vector<float> values() const {
    std::vector<float> out;
    for (int64_t e = e0; e < e0 + ne; ++e) {
      for (int64_t part = 0; part < 2; ++part) {
        for (int64_t f = f0; f < f0 + nf; ++f) {
          for (int64_t h = 0; h < 3; ++h) out.push_back(float((e * 8 + part * 4 + f) * 3 + h));
        }
      }
    }
    return out;
  }
};

// The slices of `ep` x `etp` ranks (rank = ep_rank * etp + etp_rank).
std::vector<Parted> layout(int ep, int etp) {
  std::vector<Parted> out;
  for (int r = 0; r < ep * etp; ++r) {
    out.push_back({(r / etp) * (4 / ep), 4 / ep, (r % etp) * (4 / etp), 4 / etp});
  }
  return out;
}

// Writes X as `slices` (one shard each), the manifest through the ranks' merged parts.
fs::path save_parted(const TempDir& t, const std::vector<Parted>& slices) {
  const fs::path dir = iteration_dir(t.path(), 10);
  fs::create_directories(dir);
  std::vector<Manifest> parts;
  for (size_t r = 0; r < slices.size(); ++r) {
    const std::string file = shard_name("model", static_cast<int>(r));
    const std::vector<float> v = slices[r].values();
    SafetensorsWriter shard;
    const SliceRef ref = slices[r].ref(file);
    const GlobalTensor x{"x", "F32", {4, 8, 3}, {ref}};
    shard.add("x", "F32", x.slice_shape(ref), testing::as_bytes(v));
    Manifest p;
    p.iteration = 10;
    p.world_size = static_cast<int>(slices.size());
    p.files = {write_shard(dir, file, static_cast<int>(r), shard)};
    p.tensors = {x};
    parts.push_back(parse_manifest_part(p.to_json_text(), "part"));
  }
  write_manifest(dir, merge_manifest_parts(parts, dir.string()));
  write_tracker(t.path(), 10);
  return dir;
}

std::vector<float> read_slice(CheckpointReader& r, const SliceRef& want, size_t n) {
  std::vector<float> out(n);
  r.read("x", "F32", want, std::as_writable_bytes(std::span<float>(out)));
  return out;
}

// Saved at EP 2 x ETP 2 (4 ranks): each rank's whole local tensor comes back byte-equal, and so
// does every slice of the other layouts (EP 4, ETP 4, EP 1 x ETP 2, one rank), flat ranges of
// it (the distributed optimizer's pieces), and ranges of one dimension; and the reverse: saved
// at those layouts, or flat, read as EP 2 x ETP 2.
TEST(CheckpointDir, ReadsPartedSlicesOfTwoDimensionsIntoAnyLayout) {
  std::vector<float> all(96);
  std::iota(all.begin(), all.end(), 0.0f);
  const std::vector<std::pair<int, int>> layouts = {{2, 2}, {4, 1}, {1, 4}, {1, 2}, {2, 1},
                                                    {1, 1}, {4, 2}};
  for (const auto& [sep, setp] : layouts) {
    SCOPED_TRACE(::testing::Message() << "saved at EP " << sep << " x ETP " << setp);
    TempDir t;
    CheckpointReader r(save_parted(t, layout(sep, setp)));
    EXPECT_EQ(r.manifest().needed_version(), setp > 1 ? 1 : 0);
    EXPECT_EQ(read_slice(r, SliceRef{}, 96), all);
    for (const auto& [ep, etp] : layouts) {
      for (const Parted& p : layout(ep, etp)) {
        EXPECT_EQ(read_slice(r, p.ref(), p.values().size()), p.values())
            << "EP " << ep << " x ETP " << etp << ": experts " << p.e0 << "+" << p.ne
            << ", rows " << p.f0 << "+" << p.nf;
      }
    }
    for (const auto& [lo, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 96}, {5, 40}, {95, 1},
                                                                        {13, 0}, {30, 31}}) {
      std::vector<float> out(static_cast<size_t>(n));
      r.read_flat("x", "F32", lo, n, std::as_writable_bytes(std::span<float>(out)));
      EXPECT_EQ(out, std::vector<float>(all.begin() + lo, all.begin() + lo + n)) << lo;
    }
    // Rows [2, 6) of dimension 1 (straddling the halves) of every expert.
    std::vector<float> want;
    for (int64_t e = 0; e < 4; ++e)
      for (int64_t f = 2; f < 6; ++f)
        for (int64_t h = 0; h < 3; ++h) want.push_back(all[(e * 8 + f) * 3 + h]);
    std::vector<float> got(want.size());
    r.read("x", "F32", 1, 2, 4, std::as_writable_bytes(std::span<float>(got)));
    EXPECT_EQ(got, want);
    // Out of bounds, and a destination of the wrong size.
    std::vector<float> buf(24);
    const auto dst = std::as_writable_bytes(std::span<float>(buf));
    EXPECT_ERROR_HAS(r.read("x", "F32", SliceRef{"", 0, 0, 2, 1, SliceDim{1, 3, 2, 2}}, dst),
                     "tensor 'x' [4, 8, 3] has no range [3, 5) along dimension 1 in 2 parts");
    EXPECT_ERROR_HAS(r.read("x", "F32", SliceRef{"", 0, 0, 2, 1, SliceDim{1, 0, 4, 2}}, dst),
                     "is 192 bytes, the destination 96");
  }
  // Flat pieces (the distributed optimizer at ETP 1), read as the EP 2 x ETP 2 ranks' slices.
  for (int ranks : {3, 5}) {
    TempDir t;
    testing::GlobalValues x = testing::GlobalValues::of("x", "F32", {4, 8, 3}, all, true);
    x.flat = true;
    CheckpointReader r(testing::write_checkpoint(t.path(), 10, ranks, {x}));
    for (const Parted& p : layout(2, 2)) {
      EXPECT_EQ(read_slice(r, p.ref(), p.values().size()), p.values()) << "flat over " << ranks;
    }
  }
}

// The distributed optimizer's pieces of tensor-parallel slices (version 2): each rank of every
// layout's slices cut into `cuts` ranges of its storage (owned by a data-parallel group), written
// as ranged slices without gathering; every form reads back from them: the slices of every
// layout, whole, flat ranges, and ranged pieces of other layouts' slices (other cuts); and
// ranged pieces read from plain slices.
TEST(CheckpointDir, ReadsRangedSlicesIntoAnyLayout) {
  std::vector<float> all(96);
  std::iota(all.begin(), all.end(), 0.0f);
  const std::vector<std::pair<int, int>> layouts = {{2, 2}, {1, 2}, {4, 2}, {1, 4}, {4, 1}};
  // Storage [lo, hi) of each of `cuts` uneven pieces of n elements.
  const auto cut = [](int64_t n, int cuts) {
    std::vector<std::pair<int64_t, int64_t>> out;
    int64_t lo = 0;
    for (int k = 0; k < cuts; ++k) {
      const int64_t hi = k + 1 == cuts ? n : std::min(n, lo + n / cuts + (k % 2 == 0 ? 3 : -2));
      out.push_back({lo, std::max(lo, hi)});
      lo = std::max(lo, hi);
    }
    return out;
  };
  for (const auto& [sep, setp] : layouts) {
    SCOPED_TRACE(::testing::Message() << "pieces of EP " << sep << " x ETP " << setp);
    TempDir t;
    const fs::path dir = iteration_dir(t.path(), 10);
    fs::create_directories(dir);
    std::vector<Manifest> parts;
    int rank = 0;
    for (const Parted& p : layout(sep, setp)) {
      const std::vector<float> v = p.values();
      for (const auto& [lo, hi] : cut(static_cast<int64_t>(v.size()), 3)) {
        const std::string file = shard_name("optim", rank);
        SliceRef ref = p.ref(file);
        if (ref.whole()) {  // one rank holds it all: a flat piece, as a contiguous slice's
          ref = {file, SliceRef::kFlat, lo, hi - lo};
        } else {
          ref.range = {lo, hi - lo};
        }
        const GlobalTensor x{"x", "F32", {4, 8, 3}, {ref}};
        SafetensorsWriter shard;
        shard.add("x", "F32", x.slice_shape(ref),
                  testing::as_bytes(std::vector<float>(v.begin() + lo, v.begin() + hi)));
        Manifest part;
        part.iteration = 10;
        part.world_size = 3 * sep * setp;
        part.files = {write_shard(dir, file, rank, shard)};
        part.tensors = {x};
        parts.push_back(parse_manifest_part(part.to_json_text(), "part"));
        ++rank;
      }
    }
    write_manifest(dir, merge_manifest_parts(parts, dir.string()));
    CheckpointReader r(dir, HashCheck::OnRead);
    EXPECT_EQ(r.manifest().needed_version(), kManifestVersionRanged);
    EXPECT_EQ(read_slice(r, SliceRef{}, 96), all);
    for (const auto& [ep, etp] : layouts) {
      for (const Parted& p : layout(ep, etp)) {
        const std::vector<float> v = p.values();
        EXPECT_EQ(read_slice(r, p.ref(), v.size()), v) << "EP " << ep << " x ETP " << etp;
        if (p.ref().whole()) continue;
        for (const auto& [lo, hi] : cut(static_cast<int64_t>(v.size()), 4)) {
          SliceRef want = p.ref();
          want.range = {lo, hi - lo};
          EXPECT_EQ(read_slice(r, want, static_cast<size_t>(hi - lo)),
                    std::vector<float>(v.begin() + lo, v.begin() + hi))
              << "EP " << ep << " x ETP " << etp << ", storage [" << lo << ", " << hi << ")";
        }
      }
    }
    for (const auto& [lo, n] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 96}, {7, 50}, {95, 1}}) {
      std::vector<float> out(static_cast<size_t>(n));
      r.read_flat("x", "F32", lo, n, std::as_writable_bytes(std::span<float>(out)));
      EXPECT_EQ(out, std::vector<float>(all.begin() + lo, all.begin() + lo + n)) << lo;
    }
  }
  // Ranged pieces from plain slices (a checkpoint without the distributed optimizer loaded with
  // it), and a range that does not fit its slice.
  TempDir t;
  CheckpointReader r(save_parted(t, layout(2, 2)));
  const Parted p = layout(1, 4)[1];
  SliceRef want = p.ref();
  want.range = {5, 15};
  const std::vector<float> v = p.values();
  ASSERT_EQ(v.size(), 24u);
  EXPECT_EQ(read_slice(r, want, 15), std::vector<float>(v.begin() + 5, v.begin() + 20));
  want.range = {20, 10};
  std::vector<float> buf(10);
  EXPECT_ERROR_HAS(r.read("x", "F32", want, std::as_writable_bytes(std::span<float>(buf))),
                   "a slice of 24 elements has no range [20, 30)");
}

// A global tensor of 65536 floats split over 2 shards of 128 KiB, in chunks of 4 KiB: a read of
// a few elements reads (and hashes) only the chunks that hold them and the header's, never the
// whole shard; a flipped byte in a chunk is caught when that chunk is read, before any of its
// bytes is used, and a read that does not touch it still succeeds; HashCheck::Upfront hashes
// every shard whole at the open and catches it there.
TEST(CheckpointDir, VerifiesTheChunksItReadsAndReadsOnlyThose) {
  TempDir t;
  const fs::path dir = iteration_dir(t.path(), 3);
  fs::create_directories(dir);
  std::vector<float> all(65536);
  std::iota(all.begin(), all.end(), 0.0f);
  Manifest m;
  m.iteration = 3;
  m.world_size = 2;
  GlobalTensor x{"x", "F32", {256, 256}, {}};
  for (int r = 0; r < 2; ++r) {
    const std::string file = shard_name("model", r);
    SafetensorsWriter w;
    w.add("x", "F32", {128, 256},
          testing::as_bytes(
              std::vector<float>(all.begin() + r * 32768, all.begin() + (r + 1) * 32768)));
    m.files.push_back(write_shard(dir, file, r, w, 4096));
    x.slices.push_back({file, 0, r * 128, 128});
  }
  m.tensors = {x};
  write_manifest(dir, m);
  ASSERT_EQ(m.files[1].chunk_bytes, 4096u);
  ASSERT_EQ(m.files[1].num_chunks(), (m.files[1].bytes + 4095) / 4096);
  const auto read_flat = [](CheckpointReader& r, int64_t lo, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    r.read_flat("x", "F32", lo, n, std::as_writable_bytes(std::span<float>(out)));
    return out;
  };
  {
    CheckpointReader r(dir, HashCheck::OnRead);
    EXPECT_EQ(read_flat(r, 40000, 3), (std::vector<float>{40000, 40001, 40002}));
    EXPECT_EQ(r.opened(), std::vector<std::string>{shard_name("model", 1)});
    // The header's chunk and the one holding elements [7232, 7235) of the shard's tensor.
    EXPECT_LE(r.bytes_read(), 2u * 4096) << "of a " << m.files[1].bytes << "-byte shard";
  }
  // A byte of element 60000 (in shard 1, far from the header and from element 40000) flipped.
  const fs::path p = dir / shard_name("model", 1);
  std::string bytes = testing::read_text(p);
  const size_t at = bytes.size() - (65536 - 60000) * 4;
  bytes[at] ^= 0x01;
  testing::write_text(p, bytes);
  {
    CheckpointReader r(dir, HashCheck::OnRead);
    EXPECT_EQ(read_flat(r, 40000, 3), (std::vector<float>{40000, 40001, 40002}));
    const uint64_t chunk = at / 4096;
    EXPECT_ERROR_HAS(read_flat(r, 59999, 2), "shard 'model_rank_00001.safetensors' has SHA-256 ");
    EXPECT_ERROR_HAS(read_flat(r, 59999, 2),
                     fmt::format("in bytes [{}, {}) (chunk {} of {}), the manifest recorded",
                                 chunk * 4096, (chunk + 1) * 4096, chunk, m.files[1].num_chunks()));
  }
  EXPECT_ERROR_HAS(CheckpointReader r(dir), "the file was altered after the save");
  // Without chunk digests (a manifest of an older moecore) the shard is hashed whole, streaming,
  // when first opened: the flipped byte is caught before any read, even of another chunk.
  Manifest old = m;
  for (ShardFile& f : old.files) {
    f.chunk_bytes = 0;
    f.chunk_sha256.clear();
  }
  write_manifest(dir, old);
  CheckpointReader r(dir, HashCheck::OnRead);
  EXPECT_ERROR_HAS(read_flat(r, 40000, 3), "shard 'model_rank_00001.safetensors' has SHA-256 ");
  EXPECT_EQ(read_flat(r, 5, 2), (std::vector<float>{5, 6}));  // shard 0 is intact
}

// A shard whose header is not a valid safetensors header is refused naming the file and the
// fault, however its digests agree with the manifest: the header's validation stays.
TEST(CheckpointDir, ValidatesAShardsHeaderAsSafetensorsFileDoes) {
  TempDir t;
  const fs::path dir = save(t, 2);
  Manifest m = CheckpointReader(dir).manifest();
  // Rank 1's shard rewritten with a gap before its tensor, and its digests recorded.
  const std::string header = R"({"w":{"dtype":"F32","shape":[2,3,2],"data_offsets":[4,52]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(52, '\0');
  const fs::path p = dir / shard_name("model", 1);
  testing::write_text(p, file);
  ShardDigester d(chunk_bytes_for(file.size()));
  d.update(testing::as_bytes(file));
  ShardFile f;
  f.file = shard_name("model", 1);
  f.rank = 1;
  d.finish(f);
  for (ShardFile& g : m.files) {
    if (g.file == f.file) g = f;
  }
  write_manifest(dir, m);
  CheckpointReader r(dir, HashCheck::OnRead);
  std::vector<float> w(12);
  EXPECT_ERROR_HAS(r.read("w", "F32", 0, 2, 2, std::as_writable_bytes(std::span<float>(w))),
                   "gap: bytes [0, 4) of the data block belong to no tensor");
}

}  // namespace
}  // namespace moecore::ckpt
