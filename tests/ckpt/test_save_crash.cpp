// A save killed at each of its steps (kSaveKillPoints, a forked child per point), as a fresh save
// of a new iteration and as a re-save of the iteration the tracker names: the tracker always
// names a checkpoint that reads back whole with the old or the new values, and startup recovery
// leaves only complete iter_* directories, with the values the protocol promises. Also: the
// debris of earlier moecore versions recovered, the only complete copy never removed, and a
// directory where a file is expected refused with its path.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "ckpt_files.h"
#include "core/fault_injection.h"
#include "train/save_in_flight.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

constexpr int64_t kN = 4;  // elements of the weight w and of its moment exp_avg.w

// One save of `iteration` through the trainer's protocol on one rank (checkpointing.cpp's
// save_checkpoint and train::SaveInFlight): the staging dir, a model and an optimizer shard,
// then the manifest, the publication and the tracker. Every element of both tensors is `value`.
void save_iteration(const fs::path& save, int64_t iteration, float value) {
  train::SaveInFlight s;
  s.save = save;
  s.staging = begin_staging(save, iteration);
  s.iteration = iteration;
  s.part.iteration = iteration;
  s.files[0] = shard_name("model", 0);
  s.files[1] = shard_name("optim", 0);
  const std::vector<float> values(kN, value);
  const char* names[2] = {"w", "exp_avg.w"};
  for (int k = 0; k < 2; ++k) {
    s.shards[k].add(names[k], "F32", {kN}, testing::as_bytes(values));
    s.part.tensors.push_back({names[k], "F32", {kN}, {SliceRef{s.files[k]}}});
  }
  s.head.layout = {{"dp", 1}};
  s.head.state = {{"iteration", iteration}};
  s.write();
  s.finish(nullptr);
}

// The value every element of w and exp_avg.w holds in `dir`, after the whole checkpoint is
// validated (every shard's size and SHA-256); -1 when they disagree.
float value_in(const fs::path& dir, int64_t iteration) {
  CheckpointReader r(dir, HashCheck::Upfront);
  EXPECT_EQ(r.manifest().iteration, iteration) << dir;
  std::vector<float> got(2 * kN);
  r.read("w", "F32", -1, 0, 0, std::as_writable_bytes(std::span<float>(got.data(), kN)));
  r.read("exp_avg.w", "F32", -1, 0, 0,
         std::as_writable_bytes(std::span<float>(got.data() + kN, kN)));
  for (float v : got) {
    if (v != got[0]) return -1;
  }
  return got[0];
}

size_t index_of(std::string_view name) {
  for (size_t i = 0; i < std::size(kSaveKillPoints); ++i) {
    if (kSaveKillPoints[i].name == name) return i;
  }
  ADD_FAILURE() << "no kill point " << name;
  return 0;
}

bool is_debris(const std::string& name) {
  return name.find(".partial") != std::string::npos || name.find(".replaced") != std::string::npos;
}

// Every point, for a save of iteration 20 after iteration 10 (fresh) and for a re-save of the
// tracked iteration 10 (resave). The old values are 1, the new ones 2.
void kill_at_every_point(bool resave) {
  const int64_t old_it = 10, new_it = resave ? 10 : 20;
  for (size_t i = 0; i < std::size(kSaveKillPoints); ++i) {
    const SaveKillPoint& point = kSaveKillPoints[i];
    SCOPED_TRACE(std::string(resave ? "re-save" : "fresh save") + " killed at " +
                 std::string(point.name));
    TempDir t;
    const fs::path save = t.path();
    save_iteration(save, old_it, 1.0f);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // the saving process that dies; _exit: no gtest teardown in the child
      fault::inject_for_test("kill:at=" + std::string(point.name));
      try {
        save_iteration(save, new_it, 2.0f);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    const bool reached = resave || !point.replacing_only;
    if (reached) {
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "the save was not killed at " << point.name << ": status " << status;
    } else {  // a fresh save passes no aside step: it completes
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
    }
    // What the protocol promises: a fresh save's iteration is the latest once the tracker is
    // written; a re-save's new copy is read from its publication on, and from the manifest on
    // once recovered (recovery publishes a finished save).
    const size_t k = reached ? i : std::size(kSaveKillPoints);
    const bool tracker_moved = k >= index_of("save.after_tracker");
    const int64_t tracked = tracker_moved ? new_it : old_it;
    const float before = resave ? (k >= index_of("publish.after_rename") ? 2.0f : 1.0f)
                                : (tracker_moved ? 2.0f : 1.0f);
    const float after = resave ? (k >= index_of("save.after_manifest") ? 2.0f : 1.0f) : before;

    // Before any recovery: the tracker names a whole checkpoint (an earlier copy moved aside
    // counts: find_iteration_dir).
    std::optional<int64_t> it;
    ASSERT_EQ(testing::error_of([&] { it = read_tracker(save); }), "");
    ASSERT_EQ(it, tracked);
    EXPECT_EQ(value_in(find_iteration_dir(save, *it), *it), before);
    bool debris = false;
    for (const std::string& e : t.entries()) debris = debris || is_debris(e);

    // Recovery: says what it did exactly when there was debris, and leaves only the tracker and
    // complete iter_* directories, the tracked one in its usual place.
    const std::string did = recover_checkpoint_dir(save);
    EXPECT_EQ(!did.empty(), debris) << did;
    for (const std::string& e : t.entries()) {
      if (e == kTrackerFile) continue;
      int64_t n = -1;
      ASSERT_EQ(std::sscanf(e.c_str(), "iter_%07ld", &n), 1) << e;
      ASSERT_EQ(e, iteration_dir(save, n).filename().string()) << "debris left: " << e;
      const float v = value_in(save / e, n);
      EXPECT_TRUE(v == 1.0f || v == 2.0f) << e << " holds " << v;
    }
    ASSERT_EQ(read_tracker(save), tracked);
    EXPECT_EQ(value_in(iteration_dir(save, tracked), tracked), after);
    EXPECT_EQ(recover_checkpoint_dir(save), "");  // nothing left to do
    // And the next save of the iteration goes through.
    save_iteration(save, new_it, 3.0f);
    EXPECT_EQ(read_tracker(save), new_it);
    EXPECT_EQ(value_in(iteration_dir(save, new_it), new_it), 3.0f);
  }
}

TEST(SaveCrash, FreshSaveKilledAtEveryStep) {
  kill_at_every_point(/*resave=*/false);
}

TEST(SaveCrash, ResaveOfTheTrackedIterationKilledAtEveryStep) {
  kill_at_every_point(/*resave=*/true);
}

TEST(SaveCrash, KillPointsAreUniqueAndNamedInOnePlace) {
  for (size_t i = 0; i < std::size(kSaveKillPoints); ++i) {
    for (size_t j = i + 1; j < std::size(kSaveKillPoints); ++j)
      EXPECT_NE(kSaveKillPoints[i].name, kSaveKillPoints[j].name);
  }
  EXPECT_ERROR_HAS(save_kill_point("publish.after_nothing", 0),
                   "kill point 'publish.after_nothing' is not in kSaveKillPoints");
}

// What a kill between the two renames of a re-save left with earlier versions of moecore:
// iter_N gone, the earlier copy as iter_N.replaced.<pid>, the new one finished or not in
// iter_N.partial. The load names the copies; recovery restores the earlier copy (unfinished
// new one) or publishes the new one (finished).
TEST(SaveCrash, DebrisOfEarlierVersionsIsRecovered) {
  for (const bool finished : {false, true}) {
    SCOPED_TRACE(finished ? "the new copy finished" : "the new copy unfinished");
    TempDir t;
    const fs::path save = t.path();
    save_iteration(save, 10, 1.0f);
    const fs::path staging = begin_staging(save, 10);
    testing::write_text(staging / shard_name("model", 0), "half a shard");
    if (finished) {
      fs::remove_all(staging);
      fs::copy(iteration_dir(save, 10), staging, fs::copy_options::recursive);
    }
    const fs::path old_aside = save / "iter_0000010.replaced.4242";
    fs::rename(iteration_dir(save, 10), old_aside);
    const std::string e = testing::error_of([&] { read_tracker(save); });
    EXPECT_NE(e.find("names iteration 10, but '" +
                     (iteration_dir(save, 10) / kManifestFile).string() + "' does not exist"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find(finished ? "iter_0000010.replaced.4242, iter_0000010.partial"
                              : "interrupted save: iter_0000010.replaced.4242:"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("moecore checkpoint recover " + save.string()), std::string::npos) << e;
    const std::string did = recover_checkpoint_dir(save);
    EXPECT_EQ(did, finished ? "published the finished save iter_0000010.partial as "
                              "iter_0000010; removed iter_0000010.replaced.4242 (earlier copies "
                              "of iteration 10; iter_0000010 is complete)"
                            : "removed the unfinished save iter_0000010.partial; restored "
                              "iter_0000010 from iter_0000010.replaced.4242");
    EXPECT_EQ(t.entries(), (std::vector<std::string>{"iter_0000010", std::string(kTrackerFile)}));
    EXPECT_EQ(read_tracker(save), 10);
    EXPECT_EQ(value_in(iteration_dir(save, 10), 10), 1.0f);
  }
}

// Recovery never removes the only complete copy of an iteration, nor an aside copy beside an
// iteration directory that is not complete.
TEST(SaveCrash, RecoveryKeepsTheOnlyCompleteCopy) {
  TempDir t;
  const fs::path save = t.path();
  save_iteration(save, 10, 1.0f);
  // iter_10 incomplete (its manifest lost), the complete copy aside.
  fs::rename(iteration_dir(save, 10), replaced_dir(save, 10));
  fs::create_directory(iteration_dir(save, 10));
  EXPECT_EQ(recover_checkpoint_dir(save),
            "left iter_0000010.replaced as they are: iter_0000010 is not a complete checkpoint");
  EXPECT_EQ(value_in(replaced_dir(save, 10), 10), 1.0f);
  // No complete copy aside and none in place: nothing is removed.
  fs::remove(replaced_dir(save, 10) / kManifestFile);
  fs::remove(iteration_dir(save, 10));
  EXPECT_EQ(recover_checkpoint_dir(save),
            "left iter_0000010.replaced: no complete copy of iteration 10 among them");
  EXPECT_TRUE(fs::exists(replaced_dir(save, 10) / shard_name("model", 0)));
  // A missing directory has nothing to recover.
  EXPECT_EQ(recover_checkpoint_dir(save / "none"), "");
}

// A directory (or a file) where the other is expected: an error naming the path, never an
// uncaught std::filesystem exception.
TEST(SaveCrash, DirectoryWhereAFileIsExpectedIsNamed) {
  TempDir t;
  const fs::path save = t.path();
  save_iteration(save, 10, 1.0f);
  const fs::path dir = iteration_dir(save, 10);
  const fs::path tracker = save / kTrackerFile;

  fs::remove(tracker);
  fs::create_directory(tracker);
  EXPECT_ERROR_HAS(read_tracker(save),
                   "'" + tracker.string() + "' is a directory, not the tracker");
  EXPECT_ERROR_HAS(write_tracker(save, 10), "cannot write '" + tracker.string() + "'");
  EXPECT_ERROR_HAS(write_tracker(save, 10), "a directory is in the way");
  fs::remove(tracker);
  write_tracker(save, 10);

  const fs::path shard = dir / shard_name("optim", 0);
  fs::rename(shard, save / "moved");
  fs::create_directory(shard);
  EXPECT_ERROR_HAS(CheckpointReader r(dir),
                   "shard '" + shard_name("optim", 0) + "' (rank 0) is a directory, not a file");
  fs::remove(shard);
  fs::rename(save / "moved", shard);

  const fs::path manifest = dir / kManifestFile;
  fs::rename(manifest, save / "moved");
  fs::create_directory(manifest);
  EXPECT_ERROR_HAS(CheckpointReader r(dir), "'" + manifest.string() + "' is a directory");
  fs::remove(manifest);
  fs::rename(save / "moved", manifest);

  // A file where the iteration's directory goes: the save stops before touching it.
  testing::write_text(save / "plain", "x");
  EXPECT_ERROR_HAS(CheckpointReader r(save / "plain"), "is a file, not a checkpoint directory");
  const fs::path in_the_way = iteration_dir(save, 20);
  testing::write_text(in_the_way, "not a checkpoint");
  EXPECT_ERROR_HAS(save_iteration(save, 20, 2.0f),
                   "'" + in_the_way.string() + "' is a file, not a checkpoint directory");
  EXPECT_EQ(testing::read_text(in_the_way), "not a checkpoint");
  EXPECT_EQ(read_tracker(save), 10);
  EXPECT_EQ(value_in(dir, 10), 1.0f);
}

}  // namespace
}  // namespace moecore::ckpt
