// `moecore checkpoint compare`, which the bitwise-resume and byte-equal-after-reshard claims rest
// on (tests/train/checkpoint_layouts.sh): checkpoints written by different layouts with the same
// values compare equal; one value changed in one weight or one AdamW moment, in otherwise valid
// checkpoints (every shard's SHA-256 right), is named with its tensor and byte and exits 1; the
// comparison is of bytes, not of float values; a checkpoint that cannot be read exits 2, never 1.
// `moecore checkpoint info` reads a --save directory a crash left in the middle of a re-save, and
// `moecore checkpoint recover` cleans it up, saying what it did.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "ckpt/checkpoint_command.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt_files.h"
#include "common/command.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::GlobalValues;
using testing::TempDir;

// The values of a small trained state: an expert weight W [4, 3, 2] (split over the EP ranks)
// holding 0..23, a bias B [5] (rank 0's), and AdamW's two moments of each in the optim shards.
struct State {
  std::vector<float> w = std::vector<float>(24), b = {100, 101, 102, 103, 104};
  std::vector<float> w_avg = std::vector<float>(24), w_avg_sq = std::vector<float>(24);
  std::vector<float> b_avg = {1, 2, 3, 4, 5}, b_avg_sq = {6, 7, 8, 9, 10};
  bool optim = true;
  std::vector<int64_t> w_shape = {4, 3, 2};

  State() {
    std::iota(w.begin(), w.end(), 0.0f);
    for (size_t i = 0; i < 24; ++i) {
      w_avg[i] = 0.5f * static_cast<float>(i) - 3.0f;
      w_avg_sq[i] = 0.25f * static_cast<float>(i) + 1.0f;
    }
  }

  // Saved as `ranks` ranks would save it, into `save`; returns `save`.
  fs::path write(const fs::path& save, int ranks) const {
    std::vector<GlobalValues> t = {GlobalValues::of("w", "F32", w_shape, w, true),
                                   GlobalValues::of("b", "F32", {5}, b)};
    if (optim) {
      t.push_back(GlobalValues::of("exp_avg.w", "F32", {4, 3, 2}, w_avg, true, "optim"));
      t.push_back(GlobalValues::of("exp_avg_sq.w", "F32", {4, 3, 2}, w_avg_sq, true, "optim"));
      t.push_back(GlobalValues::of("exp_avg.b", "F32", {5}, b_avg, false, "optim"));
      t.push_back(GlobalValues::of("exp_avg_sq.b", "F32", {5}, b_avg_sq, false, "optim"));
    }
    testing::write_checkpoint(save, 20, ranks, t);
    return save;
  }
};

moecore::testing::CommandResult compare_cli(const fs::path& a, const fs::path& b,
                                            const std::string& flags = "") {
  return moecore::testing::run_moecore("checkpoint compare " + a.string() + " " + b.string() +
                                       flags);
}

bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

TEST(CheckpointCompare, TheSameValuesCompareEqualWhateverTheLayouts) {
  TempDir t;
  const State s;
  const fs::path four = s.write(t / "ep4", 4);
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << ranks << " rank(s) against 4");
    const fs::path other = s.write(t / ("ep" + std::to_string(ranks) + "_again"), ranks);
    EXPECT_EQ(compare_checkpoints(other, four), std::vector<std::string>{});
  }
  // The command, on a --save directory and on an iteration directory.
  const auto r = compare_cli(t / "ep1_again", iteration_dir(four, 20));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "the same global tensors, bytewise")) << r.output;
}

// One weight value changed (13 -> 13.5: one byte of the f32), the two checkpoints in different
// layouts (4 ranks, each holding one expert, against one rank holding W whole): the difference is
// named by tensor and byte, in either order, with and without --weights-only.
TEST(CheckpointCompare, OneValueOfOneWeightIsNamed) {
  TempDir t;
  const State s;
  State changed;
  changed.w[13] = 13.5f;  // expert 2: rank 2's slice in the 4-rank checkpoint
  const fs::path a = s.write(t / "a", 4), b = changed.write(t / "b", 1);
  const std::string line = "'w': 1 of 96 bytes differ (the first at byte 54)";
  EXPECT_EQ(compare_checkpoints(a, b), std::vector<std::string>{line});
  EXPECT_EQ(compare_checkpoints(b, a), std::vector<std::string>{line});
  for (const std::string flags : {"", " --weights-only"}) {
    SCOPED_TRACE(flags);
    const auto r = compare_cli(a, b, flags);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(has(r.output, line + "\n")) << r.output;
    EXPECT_TRUE(has(r.output, ": 1 difference(s)")) << r.output;
    EXPECT_FALSE(has(r.output, "the same global tensors")) << r.output;
  }
}

// One value of one AdamW moment one ulp apart (the optimizer state a resumed run must carry
// bitwise): named; --weights-only leaves the moments out and finds the weights equal.
TEST(CheckpointCompare, OneValueOfOneAdamMomentIsNamed) {
  TempDir t;
  const State s;
  State changed;
  changed.w_avg_sq[20] = std::nextafter(s.w_avg_sq[20], 100.0f);  // expert 3, the lowest byte
  const fs::path a = s.write(t / "a", 4), b = changed.write(t / "b", 2);
  const std::string line = "'exp_avg_sq.w': 1 of 96 bytes differ (the first at byte 80)";
  EXPECT_EQ(compare_checkpoints(a, b), std::vector<std::string>{line});
  EXPECT_EQ(compare_checkpoints(a, b, {"exp_avg.", "exp_avg_sq."}), std::vector<std::string>{});
  auto r = compare_cli(a, b);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, line + "\n")) << r.output;
  r = compare_cli(a, b, " --weights-only");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "the same global tensors, bytewise")) << r.output;

  // A difference in every tensor at once: one line each, in the manifest's order.
  State all = changed;
  all.w[0] = -1;
  all.b[4] = 0;
  all.w_avg[23] = 7;
  all.b_avg[0] = -1;
  all.b_avg_sq[2] = 0;
  r = compare_cli(a, all.write(t / "all", 1));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output,
                  "'w': 2 of 96 bytes differ (the first at byte 2)\n"
                  "'b': 2 of 20 bytes differ (the first at byte 18)\n"
                  "'exp_avg.w': 2 of 96 bytes differ (the first at byte 94)\n"
                  "'exp_avg_sq.w': 1 of 96 bytes differ (the first at byte 80)\n"
                  "'exp_avg.b': 1 of 20 bytes differ (the first at byte 3)\n"
                  "'exp_avg_sq.b': 1 of 20 bytes differ (the first at byte 11)\n"))
      << r.output;
  EXPECT_TRUE(has(r.output, ": 6 difference(s)")) << r.output;
}

// Bytes, not float values: +0 and -0 are equal as floats but not the same checkpoint (a resumed
// run that flips a sign bit is not bitwise the same run).
TEST(CheckpointCompare, ComparesBytesNotFloatValues) {
  TempDir t;
  State s, changed;
  s.b[2] = 0.0f;
  changed.b[2] = -0.0f;
  ASSERT_EQ(s.b, changed.b);  // equal as floats
  EXPECT_EQ(compare_checkpoints(s.write(t / "a", 1), changed.write(t / "b", 1)),
            std::vector<std::string>{"'b': 1 of 20 bytes differ (the first at byte 11)"});
}

// Tensors in one checkpoint only (a save without its optimizer state) and another shape.
TEST(CheckpointCompare, NamesTensorsInOneOnlyAndOtherShapes) {
  TempDir t;
  const State s;
  State no_optim;
  no_optim.optim = false;
  const fs::path a = s.write(t / "a", 2), b = no_optim.write(t / "b", 2);
  const std::vector<std::string> want = {
      "'exp_avg.w': only in " + iteration_dir(a, 20).string(),
      "'exp_avg_sq.w': only in " + iteration_dir(a, 20).string(),
      "'exp_avg.b': only in " + iteration_dir(a, 20).string(),
      "'exp_avg_sq.b': only in " + iteration_dir(a, 20).string()};
  EXPECT_EQ(compare_checkpoints(a, b), want);
  auto r = compare_cli(a, b);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, ": 4 difference(s)")) << r.output;
  r = compare_cli(a, b, " --weights-only");
  EXPECT_EQ(r.exit_code, 0) << r.output;

  State reshaped;
  reshaped.w_shape = {4, 6};
  EXPECT_EQ(compare_checkpoints(a, reshaped.write(t / "c", 1)),
            std::vector<std::string>{"'w': F32 [4, 3, 2] and F32 [4, 6]"});
}

// A checkpoint that cannot be read (a shard altered after the save, a directory that is no
// checkpoint) is an error with exit status 2: never reported as, or hidden among, differences.
TEST(CheckpointCompare, AnUnreadableCheckpointIsAnErrorNotADifference) {
  TempDir t;
  const State s;
  const fs::path a = s.write(t / "a", 2), b = s.write(t / "b", 2);
  const fs::path shard = iteration_dir(b, 20) / shard_name("optim", 1);
  std::string bytes = testing::read_text(shard);
  bytes[bytes.size() - 1] ^= 0x01;
  testing::write_text(shard, bytes);
  auto r = compare_cli(a, b);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "shard 'optim_rank_00001.safetensors' has SHA-256")) << r.output;
  EXPECT_TRUE(has(r.output, "the file was altered after the save")) << r.output;
  EXPECT_FALSE(has(r.output, "difference(s)")) << r.output;
  r = compare_cli(a, t / "nothing");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "is neither a checkpoint")) << r.output;
}

// Killed between the two renames of a re-save: iter_0000020 moved aside, the finished new copy
// still staged. `info` reads the aside copy, `compare` finds it equal to the staged one,
// `recover` publishes the staged copy and says so; a second `recover` has nothing to do.
TEST(CheckpointRecover, InfoAndRecoverBetweenTheRenamesOfAResave) {
  TempDir t;
  const State s;
  const fs::path save = s.write(t / "save", 2);
  fs::copy(iteration_dir(save, 20), staging_dir(save, 20), fs::copy_options::recursive);
  fs::rename(iteration_dir(save, 20), replaced_dir(save, 20));
  auto r = moecore::testing::run_moecore("checkpoint info " + save.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, replaced_dir(save, 20).string() + "\n  iteration 20")) << r.output;
  r = compare_cli(save, staging_dir(save, 20));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = moecore::testing::run_moecore("checkpoint recover " + save.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "[checkpoint] recovered: " + save.string() +
                                ": published the finished save iter_0000020.partial as "
                                "iter_0000020 (its earlier copy, moved aside, removed)"))
      << r.output;
  EXPECT_FALSE(fs::exists(replaced_dir(save, 20)));
  EXPECT_FALSE(fs::exists(staging_dir(save, 20)));
  r = moecore::testing::run_moecore("checkpoint recover " + save.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "[checkpoint] nothing to recover: " + save.string())) << r.output;
  r = moecore::testing::run_moecore("checkpoint recover " + (t / "none").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "'" + (t / "none").string() + "' is not a directory")) << r.output;
}

}  // namespace
}  // namespace moecore::ckpt
