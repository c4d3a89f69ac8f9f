// The checkpoint manifest: what is written parses back equal; each way a manifest can be
// incomplete or inconsistent (version, files, dtypes, slices that miss or repeat indices) is
// refused naming the file, the tensor and the numbers. And the SHA-256 the manifest records.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <string>

#include "ckpt/manifest.h"
#include "ckpt/sha256.h"
#include "ckpt_files.h"

namespace moecore::ckpt {
namespace {

#define EXPECT_MANIFEST_ERROR(m, needle) \
  EXPECT_ERROR_HAS(validate_manifest(m, "iter_0000007/manifest.json"), needle)

const std::string kHash(64, 'a');

// Two ranks of EP = 2: the expert weight split along the experts, the embedding whole on rank 0.
Manifest two_rank_manifest() {
  Manifest m;
  m.iteration = 7;
  m.world_size = 2;
  m.layout = {{"dp", 1}, {"ep", 2}};
  m.state = {{"consumed_samples", 56}};
  m.files = {{"model_rank_00000.safetensors", 0, 4096, kHash, 0, {}},
             {"model_rank_00001.safetensors", 1, 2048, std::string(64, 'b'), 0, {}}};
  m.tensors = {
      {"decoder.layers.0.mlp.experts.linear_fc1.weight",
       "F32",
       {4, 16, 8},
       {{"model_rank_00001.safetensors", 0, 2, 2}, {"model_rank_00000.safetensors", 0, 0, 2}}},
      {"embedding.word_embeddings.weight", "BF16", {32, 8}, {{"model_rank_00000.safetensors"}}},
  };
  return m;
}

TEST(Manifest, RoundTripsThroughItsJson) {
  const Manifest m = two_rank_manifest();
  const std::string text = m.to_json_text();
  const Manifest back = parse_manifest(text, "manifest.json");
  EXPECT_EQ(back.to_json_text(), text);
  EXPECT_EQ(back.iteration, 7);
  EXPECT_EQ(back.world_size, 2);
  EXPECT_EQ(back.layout.at("ep"), 2);
  EXPECT_EQ(back.state.at("consumed_samples"), 56);
  ASSERT_EQ(back.tensors.size(), 2u);
  const GlobalTensor* w = back.find("decoder.layers.0.mlp.experts.linear_fc1.weight");
  ASSERT_NE(w, nullptr);
  ASSERT_EQ(w->slices.size(), 2u);
  EXPECT_EQ(w->slices[0].file, "model_rank_00001.safetensors");
  EXPECT_EQ(w->slices[0].offset, 2);
  EXPECT_EQ(w->slice_shape(w->slices[0]), (std::vector<int64_t>{2, 16, 8}));
  const GlobalTensor* e = back.find("embedding.word_embeddings.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->slices[0].dim, -1);
  EXPECT_EQ(e->slice_shape(e->slices[0]), (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(back.find("nope"), nullptr);
  ASSERT_NE(back.file("model_rank_00001.safetensors"), nullptr);
  EXPECT_EQ(back.file("model_rank_00001.safetensors")->bytes, 2048u);
}

TEST(Manifest, RefusesAnotherFormatOrVersion) {
  std::string text = two_rank_manifest().to_json_text();
  const auto replace = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  EXPECT_ERROR_HAS(parse_manifest(replace("\"format_version\": 0", "\"format_version\": 3"), "m"),
                   "format version 3; this moecore reads version 0 to 2: the checkpoint was "
                   "written by a newer moecore");
  EXPECT_ERROR_HAS(parse_manifest(replace("moecore-checkpoint", "megatron"), "m"),
                   "not a moecore checkpoint manifest");
  EXPECT_ERROR_HAS(parse_manifest(text.substr(0, text.size() / 2), "dir/manifest.json"),
                   "'dir/manifest.json': the manifest is not valid JSON");
  EXPECT_ERROR_HAS(parse_manifest("[1, 2]", "m"), "the manifest is array, not a JSON object");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"iteration\": 7", "\"iteration\": \"7\""), "m"),
                   "\"iteration\" of the manifest is string, not number");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"world_size\"", "\"world\""), "m"),
                   "the manifest has no \"world_size\"");
}

// A number outside its field's type is refused, never wrapped around into a valid one: a world
// of 2^32 + 1 read as a world of 1, -1 bytes as 2^64 - 1, a shape entry of 2^64 - 1 as -1.
TEST(Manifest, RefusesNumbersOutsideTheirType) {
  const std::string text = two_rank_manifest().to_json_text();
  const auto replace = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? t : t.replace(at, from.size(), to);
  };
  EXPECT_ERROR_HAS(parse_manifest(replace("\"world_size\": 2", "\"world_size\": 4294967298"), "m"),
                   "\"world_size\" of the manifest is 4294967298, outside [-2147483648, 2147483647]");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"rank\": 1", "\"rank\": 4294967297"), "m"),
                   "\"rank\" of shard 'model_rank_00001.safetensors' is 4294967297, outside");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"bytes\": 2048", "\"bytes\": -1"), "m"),
                   "\"bytes\" of shard 'model_rank_00001.safetensors' is -1, outside [0, ");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"dim\": 0", "\"dim\": 4294967296"), "m"),
                   "\"dim\" of a slice of tensor");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"iteration\": 7", "\"iteration\": 18446744073709551615"), "m"),
                   "\"iteration\" of the manifest is 18446744073709551615, outside");
  EXPECT_ERROR_HAS(parse_manifest(replace("\"ep\": 2", "\"ep\": 18446744073709551615"), "m"),
                   "layout \"ep\" is 18446744073709551615, not a 64-bit integer");
  EXPECT_ERROR_HAS(parse_manifest(replace("32,", "18446744073709551615,"), "m"),
                   "has a shape entry 18446744073709551615");
}

TEST(Manifest, RefusesBadShardEntries) {
  Manifest m = two_rank_manifest();
  m.files[1].file = "../elsewhere.safetensors";
  EXPECT_MANIFEST_ERROR(m, "shard name '../elsewhere.safetensors' is not a plain file name");
  m = two_rank_manifest();
  m.files[1].file = m.files[0].file;
  EXPECT_MANIFEST_ERROR(m, "shard 'model_rank_00000.safetensors' is listed twice");
  m = two_rank_manifest();
  m.files[1].rank = 2;
  EXPECT_MANIFEST_ERROR(m, "written by rank 2 of a world of 2");
  m = two_rank_manifest();
  m.files[0].sha256 = "ABC";
  EXPECT_MANIFEST_ERROR(m, "has sha256 'ABC', not 64 lowercase hex digits");
}

TEST(Manifest, RefusesBadTensorEntries) {
  Manifest m = two_rank_manifest();
  m.tensors[1].name = m.tensors[0].name;
  EXPECT_MANIFEST_ERROR(m, "is listed twice");
  m = two_rank_manifest();
  m.tensors[1].dtype = "F33";
  EXPECT_MANIFEST_ERROR(m, "tensor 'embedding.word_embeddings.weight' has dtype 'F33'");
  m = two_rank_manifest();
  m.tensors[1].shape = {32, -8};
  EXPECT_MANIFEST_ERROR(m, "has shape [32, -8]");
  m = two_rank_manifest();
  m.tensors[1].slices.clear();
  EXPECT_MANIFEST_ERROR(m, "tensor 'embedding.word_embeddings.weight' has no slice");
  m = two_rank_manifest();
  m.tensors[1].slices[0].file = "model_rank_00009.safetensors";
  EXPECT_MANIFEST_ERROR(m, "is in 'model_rank_00009.safetensors', which is not among");
}

// The slices of a tensor cover every index of the split dimension exactly once.
TEST(Manifest, RefusesSlicesThatMissOrRepeatIndices) {
  const std::string where = "iter_0000007/manifest.json";
  Manifest m = two_rank_manifest();
  m.tensors[0].slices[0].offset = 3;  // [3, 5) and [0, 2): a gap at 2
  EXPECT_MANIFEST_ERROR(m, "a slice starts at 3 where 2 was expected (gap before");
  m = two_rank_manifest();
  m.tensors[0].slices[0].offset = 1;  // [1, 3) and [0, 2): index 1 twice
  EXPECT_MANIFEST_ERROR(m, "a slice starts at 1 where 2 was expected (overlap with");
  m = two_rank_manifest();
  m.tensors[0].slices[0].length = 1;  // [0, 3) of 4
  EXPECT_MANIFEST_ERROR(m, "its slices cover 3 of the 4 indices of dimension 0");
  m = two_rank_manifest();
  m.tensors[0].slices[0].dim = 1;
  EXPECT_MANIFEST_ERROR(m, "split along dimension 1 in one slice and 0 in another");
  m = two_rank_manifest();
  m.tensors[0].slices[0].dim = m.tensors[0].slices[1].dim = 3;
  EXPECT_MANIFEST_ERROR(m, "[4, 16, 8] is split along dimension 3");
  m = two_rank_manifest();
  m.tensors[1].slices.push_back({"model_rank_00001.safetensors"});
  EXPECT_MANIFEST_ERROR(m, "has a whole-tensor slice and 1 others");
  m = two_rank_manifest();
  m.tensors[0].slices[0].length = -2;
  EXPECT_MANIFEST_ERROR(m, "has a slice at offset 2 of length -2");
  // A slice past the dimension is refused before the running end could overflow int64 (found
  // by tests/fuzz/fuzz_manifest: 2 + (2^63 - 1) was signed overflow).
  m = two_rank_manifest();
  m.tensors[0].slices[0].length = std::numeric_limits<int64_t>::max();
  EXPECT_MANIFEST_ERROR(m, "a slice of 'model_rank_00001.safetensors' at offset 2 of length "
                           "9223372036854775807 runs past dimension 0 (4 indices)");
  // The messages name the manifest's path.
  EXPECT_MANIFEST_ERROR(m, "[checkpoint] '" + where + "': tensor");
}

// The distributed optimizer's flat slices: elements of the flattened tensor, tiling [0, numel)
// exactly once, never mixed with slices of a dimension.
TEST(Manifest, FlatSlicesRoundTripAndTileTheFlattenedTensor) {
  Manifest m = two_rank_manifest();
  m.tensors[0].slices = {{"model_rank_00001.safetensors", SliceRef::kFlat, 300, 212},
                         {"model_rank_00000.safetensors", SliceRef::kFlat, 0, 300}};
  const std::string text = m.to_json_text();
  const std::string key = "\"flat_offset\": 300";
  ASSERT_NE(text.find(key), std::string::npos) << text;
  const Manifest back = parse_manifest(text, "manifest.json");
  EXPECT_EQ(back.to_json_text(), text);
  const GlobalTensor& w = back.tensors[0];
  ASSERT_EQ(w.slices.size(), 2u);
  EXPECT_TRUE(w.slices[0].flat());
  EXPECT_EQ(w.slice_shape(w.slices[0]), (std::vector<int64_t>{212}));
  EXPECT_EQ(w.numel(), 512);

  Manifest bad = m;
  bad.tensors[0].slices[0].offset = 301;  // [0, 300) and [301, 513)
  EXPECT_MANIFEST_ERROR(bad, "in flat order: a slice starts at 301 where 300 was expected (gap");
  bad = m;
  bad.tensors[0].slices[0].length = 211;
  EXPECT_MANIFEST_ERROR(bad, "its slices cover 511 of the 512 indices of the flattened tensor");
  bad = m;
  bad.tensors[0].slices[0].length = 213;
  EXPECT_MANIFEST_ERROR(bad, "at offset 300 of length 213 runs past the flattened tensor (512");
  bad = m;
  bad.tensors[0].slices[0] = {"model_rank_00001.safetensors", 0, 2, 2};  // rows and flat
  EXPECT_MANIFEST_ERROR(bad, "has slices of two kinds (dimension 0 and flat)");
  bad = m;
  bad.tensors[0].shape = {std::numeric_limits<int64_t>::max(), 4};
  EXPECT_MANIFEST_ERROR(bad, "has more than 2^63 elements");
  // Parsed: a slice with both a dimension and a flat range is refused.
  std::string both = text;
  both.replace(both.find(key), key.size(), "\"dim\": 0, \"offset\": 0, \"length\": 1, " + key);
  EXPECT_ERROR_HAS(parse_manifest(both, "m.json"), "has both \"dim\" and \"flat_offset\"");
}

// Expert weight [E = 4, 2F = 8, H = 3] (SwiGLU's [gate; up] rows) on 4 ranks of EP 2 x ETP 2:
// rank (ep, etp) holds experts [2 ep, 2 ep + 2) and rows [2 etp, 2 etp + 2) of each of the two
// halves of dimension 1 (parts 2): local shape [2, 4, 3].
Manifest ep2_etp2_manifest() {
  Manifest m;
  m.iteration = 7;
  m.world_size = 4;
  m.layout = {{"ep", 2}, {"expt_tp", 2}};
  GlobalTensor w{"decoder.layers.0.mlp.experts.linear_fc1.weight", "F32", {4, 8, 3}, {}};
  for (int r = 0; r < 4; ++r) {
    const std::string file = fmt::format("model_rank_{:05d}.safetensors", r);
    m.files.push_back({file, r, 1024, kHash, 0, {}});
    const int ep = r / 2, etp = r % 2;
    w.slices.push_back({file, 0, 2 * ep, 2, 1, SliceDim{1, 2 * etp, 2, 2}});
  }
  m.tensors = {w};
  return m;
}

// Slices in parts and of two dimensions (format version 1): they round-trip through the JSON,
// a manifest without them stays version 0, and a version 0 manifest may not hold them.
TEST(Manifest, PartedSlicesOfTwoDimensionsRoundTripAsVersion1) {
  EXPECT_EQ(two_rank_manifest().needed_version(), 0);
  EXPECT_NE(two_rank_manifest().to_json_text().find("\"format_version\": 0"), std::string::npos);
  const Manifest m = ep2_etp2_manifest();
  validate_manifest(m, "m");
  EXPECT_EQ(m.needed_version(), 1);
  const std::string text = m.to_json_text();
  ASSERT_NE(text.find("\"format_version\": 1"), std::string::npos) << text;
  ASSERT_NE(text.find("\"second\""), std::string::npos) << text;
  const Manifest back = parse_manifest(text, "m");
  EXPECT_EQ(back.to_json_text(), text);
  const GlobalTensor& w = back.tensors[0];
  ASSERT_EQ(w.slices.size(), 4u);
  EXPECT_EQ(w.slices[3].offset, 2);
  EXPECT_EQ(w.slices[3].parts, 1);
  EXPECT_EQ(w.slices[3].second.dim, 1);
  EXPECT_EQ(w.slices[3].second.offset, 2);
  EXPECT_EQ(w.slices[3].second.parts, 2);
  EXPECT_EQ(w.slice_shape(w.slices[3]), (std::vector<int64_t>{2, 4, 3}));
  // One dimension in parts (ETP 2 alone): also version 1.
  Manifest one = m;
  for (SliceRef& sl : one.tensors[0].slices) sl = {sl.file, 1, sl.second.offset, 2, 2};
  one.tensors[0].slices.resize(2);
  validate_manifest(one, "m");
  EXPECT_EQ(one.needed_version(), 1);
  EXPECT_EQ(parse_manifest(one.to_json_text(), "m").tensors[0].slices[1].parts, 2);

  std::string v0 = text;
  v0.replace(v0.find("\"format_version\": 1"), 19, "\"format_version\": 0");
  EXPECT_ERROR_HAS(parse_manifest(v0, "m"),
                   "a slice of tensor 'decoder.layers.0.mlp.experts.linear_fc1.weight' is in parts "
                   "or splits two dimensions, which format version 0 does not have");
  std::string zero_parts = text;
  zero_parts.replace(zero_parts.find("\"parts\": 2"), 10, "\"parts\": 0");
  EXPECT_ERROR_HAS(parse_manifest(zero_parts, "m"), "has \"parts\": 0, not in [1, 1024]");
}

// The parted slices of a tensor hold every element once: each in bounds, no two overlapping,
// none missing; the messages name the tensor, the files and the slices.
TEST(Manifest, RefusesPartedSlicesThatOverlapMissOrRunOut) {
  const std::string name = "tensor 'decoder.layers.0.mlp.experts.linear_fc1.weight' [4, 8, 3]";
  Manifest m = ep2_etp2_manifest();
  m.tensors[0].slices[1].second.offset = 1;  // rows 1, 2 of each half: row 1 twice
  EXPECT_MANIFEST_ERROR(m, name + ": the slices of 'model_rank_00000.safetensors' (dimension 0 "
                        "[0, 2) x dimension 1 [0, 2) of each of 2 parts) and "
                        "'model_rank_00001.safetensors' (dimension 0 [0, 2) x dimension 1 [1, 3) "
                        "of each of 2 parts) overlap");
  m = ep2_etp2_manifest();
  m.tensors[0].slices.pop_back();
  EXPECT_MANIFEST_ERROR(m, name + ": its 3 slices hold 72 of its 96 elements: a slice is missing");
  m = ep2_etp2_manifest();
  m.tensors[0].slices[3].second.offset = 3;  // [3, 5) of a part of 4 rows
  EXPECT_MANIFEST_ERROR(m, "the slice of 'model_rank_00003.safetensors' (dimension 1 [3, 5) of "
                        "each of 2 parts) is out of bounds: a part of dimension 1 has 4 indices");
  m = ep2_etp2_manifest();
  m.tensors[0].slices[0].second.parts = 3;
  EXPECT_MANIFEST_ERROR(m, "takes dimension 1 (8 indices) as 3 equal parts");
  m = ep2_etp2_manifest();
  m.tensors[0].slices[0].second.dim = 0;
  EXPECT_MANIFEST_ERROR(m, "has second dimension 0 after dimension 0");
  m = ep2_etp2_manifest();
  m.tensors[0].slices[0].second.dim = 3;
  EXPECT_MANIFEST_ERROR(m, "a slice of 'model_rank_00000.safetensors' splits dimension 3");
  m = ep2_etp2_manifest();
  m.tensors[0].slices[0] = {"model_rank_00000.safetensors", SliceRef::kFlat, 0, 24};
  EXPECT_MANIFEST_ERROR(m, "has slices of two kinds (flat and");
  m = ep2_etp2_manifest();
  m.tensors[0].slices.push_back({"model_rank_00000.safetensors"});  // and the whole tensor
  EXPECT_MANIFEST_ERROR(m, "and 'model_rank_00000.safetensors' (whole) overlap");
  // Merged from the ranks' parts (in any order): the slices in (offset, second offset) order.
  std::vector<Manifest> parts;
  const Manifest whole = ep2_etp2_manifest();
  for (int r = 3; r >= 0; --r) {
    Manifest p;
    p.iteration = whole.iteration;
    p.world_size = whole.world_size;
    p.files = {whole.files[r]};
    const GlobalTensor& w = whole.tensors[0];
    p.tensors = {{w.name, w.dtype, w.shape, {w.slices[r]}}};
    parts.push_back(parse_manifest_part(p.to_json_text(), "part"));
  }
  Manifest merged = merge_manifest_parts(parts, "iter_0000007");
  validate_manifest(merged, "iter_0000007");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(merged.tensors[0].slices[r].file, whole.tensors[0].slices[r].file);
  }
}

// The distributed optimizer's pieces of the EP 2 x ETP 2 slices (version 2): each rank's slice
// cut into 3 ranges of its storage (24 elements: [0, 5), [5, 17), [17, 24)), as a data-parallel
// group of 3 owning them would write them.
Manifest ranged_manifest() {
  Manifest m = ep2_etp2_manifest();
  std::vector<SliceRef> pieces;
  for (const SliceRef& s : m.tensors[0].slices) {
    for (const auto& [lo, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 12}, {17, 7}}) {
      SliceRef p = s;
      p.range = {lo, n};
      pieces.push_back(p);
    }
  }
  m.tensors[0].slices = pieces;
  return m;
}

// Ranged slices: version 2, round-trip through the JSON, stored as 1-D tensors of the range's
// length; an older version holding one is refused; each base slice's ranges tile its storage
// exactly, with errors naming the tensor, the files and the slices.
TEST(Manifest, RangedSlicesTileTheirSlicesStorageAsVersion2) {
  const Manifest m = ranged_manifest();
  validate_manifest(m, "m");
  EXPECT_EQ(m.needed_version(), kManifestVersionRanged);
  const std::string text = m.to_json_text();
  ASSERT_NE(text.find("\"format_version\": 2"), std::string::npos) << text;
  ASSERT_NE(text.find("\"range\""), std::string::npos) << text;
  const Manifest back = parse_manifest(text, "m");
  EXPECT_EQ(back.to_json_text(), text);
  const GlobalTensor& w = back.tensors[0];
  ASSERT_EQ(w.slices.size(), 12u);
  EXPECT_EQ(w.slices[1].range, (StorageRange{5, 12}));
  EXPECT_EQ(w.slices[1].second.parts, 2);
  EXPECT_EQ(w.slice_shape(w.slices[1]), (std::vector<int64_t>{12}));

  std::string v1 = text;
  v1.replace(v1.find("\"format_version\": 2"), 19, "\"format_version\": 1");
  EXPECT_ERROR_HAS(parse_manifest(v1, "m"),
                   "has a range, which format version 1 does not have (version 2 does): the "
                   "manifest was altered");
  const std::string name = "tensor 'decoder.layers.0.mlp.experts.linear_fc1.weight' [4, 8, 3]";
  Manifest bad = m;
  bad.tensors[0].slices[1].range = {4, 13};  // [4, 17) overlaps [0, 5)
  EXPECT_MANIFEST_ERROR(
      bad, name +
               ": the slices of 'model_rank_00000.safetensors' (dimension 0 "
               "[0, 2) x dimension 1 [0, 2) of each of 2 parts, storage [0, 5)) and "
               "'model_rank_00000.safetensors' (dimension 0 [0, 2) x dimension 1 [0, 2) "
               "of each of 2 parts, storage [4, 17)) overlap");
  bad = m;
  bad.tensors[0].slices[1].range = {6, 11};  // element 5 in no piece
  EXPECT_MANIFEST_ERROR(
      bad, name +
               ": elements [5, 6) of the storage of slice dimension 0 [0, 2) "
               "x dimension 1 [0, 2) of each of 2 parts are in no slice (after the one "
               "of 'model_rank_00000.safetensors'): a slice is missing");
  bad = m;
  bad.tensors[0].slices[2].range = {17, 6};  // [17, 23) of 24
  EXPECT_MANIFEST_ERROR(bad, "elements [23, 24) of the storage of slice dimension 0 [0, 2)");
  bad = m;
  bad.tensors[0].slices[2].range = {17, 8};
  EXPECT_MANIFEST_ERROR(bad, "runs past the 24 elements of its slice's storage");
  bad = m;
  bad.tensors[0].slices.erase(bad.tensors[0].slices.begin() + 3, bad.tensors[0].slices.begin() + 6);
  EXPECT_MANIFEST_ERROR(bad,
                        name + ": its 9 slices hold 72 of its 96 elements: a slice is missing");
  bad = m;  // a whole-slice copy beside the pieces of the same slice
  bad.tensors[0].slices.push_back(bad.tensors[0].slices[0].base());
  EXPECT_MANIFEST_ERROR(bad, "overlap: the slices must hold every element once");
  // Parsed: a range on a flat or whole slice, or negative.
  std::string neg = text;
  neg.replace(neg.find("\"offset\": 5"), 12, "\"offset\": -5");
  EXPECT_ERROR_HAS(parse_manifest(neg, "m"), "its offset and length are counts >= 0");
}

// Validation stays cheap at real scale: a tensor of 64 expert-parallel slices, each cut into 512
// ranges (32768 slices), validates in well under a second; pairwise checks over the slices would
// take minutes. The boxes are compared only where their spans of the flattened tensor overlap.
TEST(Manifest, ValidatesTensOfThousandsOfRangedSlicesWithoutComparingEveryPair) {
  Manifest m;
  m.iteration = 1;
  m.world_size = 1;
  m.files = {{"optim_rank_00000.safetensors", 0, 8, kHash, 0, {}}};
  GlobalTensor t{"exp_avg.w", "F32", {64, 64, 64}, {}};
  for (int e = 0; e < 64; ++e) {
    for (int r = 0; r < 512; ++r) {  // 4096 elements per expert: 8 each
      t.slices.push_back({"optim_rank_00000.safetensors", 0, e, 1, 1, SliceDim{2, 0, 64, 1},
                          StorageRange{r * 8, 8}});
    }
  }
  m.tensors = {t};
  const auto start = std::chrono::steady_clock::now();
  validate_manifest(m, "m");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 5.0) << "validating " << t.slices.size() << " slices";
  m.tensors[0].slices[7232].range.length += 1;  // now overlapping its successor
  EXPECT_MANIFEST_ERROR(m, "overlap: the slices must hold every element once");
}

// The per-chunk digests of a shard: one per chunk of chunk_bytes (the last short), round-trip
// through the JSON, and a count or form that does not fit is refused.
TEST(Manifest, ChunkDigestsRoundTripAndCountTheChunks) {
  Manifest m = two_rank_manifest();
  m.files[1].chunk_bytes = 1000;  // 2048 bytes: 3 chunks
  m.files[1].chunk_sha256 = {kHash, std::string(64, 'c'), std::string(64, 'd')};
  validate_manifest(m, "m");
  EXPECT_EQ(m.files[1].num_chunks(), 3u);
  const std::string text = m.to_json_text();
  ASSERT_NE(text.find("\"chunk_bytes\": 1000"), std::string::npos) << text;
  const Manifest back = parse_manifest(text, "m");
  EXPECT_EQ(back.to_json_text(), text);
  EXPECT_EQ(back.files[1].chunk_sha256[2], std::string(64, 'd'));
  EXPECT_EQ(back.files[0].chunk_bytes, 0u);  // a shard without them (an older save)
  Manifest bad = m;
  bad.files[1].chunk_sha256.pop_back();
  EXPECT_MANIFEST_ERROR(bad,
                        "shard 'model_rank_00001.safetensors' of 2048 bytes in chunks of "
                        "1000 has 2 chunk digests, not 3");
  bad = m;
  bad.files[1].chunk_sha256[1] = "x";
  EXPECT_MANIFEST_ERROR(bad, "has chunk 1 sha256 'x', not 64 lowercase hex digits");
  std::string zero = text;
  zero.replace(zero.find("\"chunk_bytes\": 1000"), 19, "\"chunk_bytes\": 0");
  EXPECT_ERROR_HAS(parse_manifest(zero, "m"), "has chunks of 0 bytes");
  // A manifest written before the chunk digests, version 0 and 1, still parses.
  EXPECT_EQ(parse_manifest(two_rank_manifest().to_json_text(), "m").files[0].chunk_bytes, 0u);
}

// The published test vectors of FIPS 180-2, and hashing in pieces equals hashing the whole.
// A multi-rank save: each rank's part (its files and slices) goes through its JSON, and the
// merge joins them into the manifest of two_rank_manifest(), slices in offset order; parts that
// repeat a slice or disagree about a tensor are refused.
TEST(Manifest, MergesTheRanksParts) {
  const Manifest whole = two_rank_manifest();
  Manifest p0, p1;
  for (Manifest* p : {&p0, &p1}) {
    p->iteration = whole.iteration;
    p->world_size = whole.world_size;
  }
  p0.files = {whole.files[0]};
  p1.files = {whole.files[1]};
  const GlobalTensor& w = whole.tensors[0];
  p0.tensors = {{w.name, w.dtype, w.shape, {w.slices[1]}}, whole.tensors[1]};
  p1.tensors = {{w.name, w.dtype, w.shape, {w.slices[0]}}};
  std::vector<Manifest> parts;
  for (const Manifest* p : {&p0, &p1})
    parts.push_back(parse_manifest_part(p->to_json_text(), "part"));
  const Manifest m = merge_manifest_parts(parts, "iter_0000007");
  validate_manifest(m, "iter_0000007");
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[1].file, "model_rank_00001.safetensors");
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.tensors[0].name, w.name);
  ASSERT_EQ(m.tensors[0].slices.size(), 2u);
  EXPECT_EQ(m.tensors[0].slices[0].offset, 0);
  EXPECT_EQ(m.tensors[0].slices[1].file, "model_rank_00001.safetensors");
  EXPECT_EQ(m.tensors[1].name, "embedding.word_embeddings.weight");

  // Rank 1 also claims the embedding: covered twice.
  parts[1].tensors.push_back(whole.tensors[1]);
  parts[1].tensors.back().slices = {{"model_rank_00001.safetensors"}};
  EXPECT_MANIFEST_ERROR(
      merge_manifest_parts(parts, "iter_0000007"),
      "tensor 'embedding.word_embeddings.weight' has a whole-tensor slice and 1 others");
  parts[1].tensors.pop_back();
  // Rank 1 has another shape for the expert weight.
  parts[1].tensors[0].shape = {4, 16, 9};
  EXPECT_ERROR_HAS(merge_manifest_parts(parts, "iter_0000007"),
                   "is F32 [4, 16, 9] in part 1, F32 [4, 16, 8] in an earlier part");
  parts[1].tensors[0].shape = w.shape;
  parts[1].iteration = 8;
  EXPECT_ERROR_HAS(merge_manifest_parts(parts, "iter_0000007"),
                   "the ranks are not saving the same checkpoint");
}

TEST(Sha256, KnownDigestsAndPieces) {
  EXPECT_EQ(sha256_hex(std::string_view("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex(std::string_view("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string a = "abcdbcdecdefdefgefghfghighijhijk", b = "ijkljklmklmnlmnomnopnopq";
  const std::span<const std::byte> pieces[] = {testing::as_bytes(a), testing::as_bytes(b)};
  EXPECT_EQ(sha256_hex(pieces), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_TRUE(is_sha256_hex(sha256_hex(std::string_view("x"))));
  EXPECT_FALSE(is_sha256_hex(std::string(63, 'a')));
  EXPECT_FALSE(is_sha256_hex(std::string(64, 'A')));
}

}  // namespace
}  // namespace moecore::ckpt
