// Atomic file replacement: the target holds the old content or the new, never a torn mix; no
// temp survives a write, failed or not; a writer killed in the middle of a write leaves the
// target as it was, and a stale temp is overwritten by the next write; every failure names the
// path.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt_files.h"

namespace moecore::ckpt {
namespace {

using testing::as_bytes;
using testing::read_text;
using testing::TempDir;

TEST(AtomicFile, TempPathIsBesideTheTargetAndNamesThePid) {
  const std::filesystem::path p = "/some/dir/latest_checkpointed_iteration.txt";
  EXPECT_EQ(temp_path_for(p).string(),
            "/some/dir/latest_checkpointed_iteration.txt.tmp." + std::to_string(::getpid()));
  EXPECT_EQ(temp_path_for(p).parent_path(), p.parent_path());
}

TEST(AtomicFile, WritesThenOverwritesAndLeavesNoTemp) {
  TempDir dir;
  const auto p = dir / "tracker.txt";
  write_file_atomic(p, std::string_view("100"));
  EXPECT_EQ(read_text(p), "100");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"tracker.txt"});
  // Longer, then shorter: the result is the new content, not the old one's tail.
  write_file_atomic(p, std::string_view("20000 and more"));
  EXPECT_EQ(read_text(p), "20000 and more");
  write_file_atomic(p, std::string_view("3"));
  EXPECT_EQ(read_text(p), "3");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"tracker.txt"});
}

TEST(AtomicFile, WritesEmptyAndBinaryContent) {
  TempDir dir;
  const auto p = dir / "empty.bin";
  write_file_atomic(p, std::span<const std::byte>());
  EXPECT_TRUE(std::filesystem::exists(p));
  EXPECT_EQ(std::filesystem::file_size(p), 0u);
  const std::string binary("a\0b\xff\n", 5);
  write_file_atomic(p, as_bytes(binary));
  EXPECT_EQ(read_text(p), binary);
}

TEST(AtomicFile, WritesTheConcatenationOfPieces) {
  TempDir dir;
  const auto p = dir / "pieces.bin";
  const std::string a = "header:", b, c = "data";
  const std::span<const std::byte> pieces[] = {as_bytes(a), as_bytes(b), as_bytes(c)};
  write_file_atomic(p, pieces);
  EXPECT_EQ(read_text(p), "header:data");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"pieces.bin"});
}

TEST(AtomicFile, RelativePathWithoutDirectory) {
  // parent_path() is empty: the directory to fsync is ".".
  TempDir dir;
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  const std::string msg =
      testing::error_of([] { write_file_atomic("rel.txt", std::string_view("x")); });
  std::filesystem::current_path(cwd);
  EXPECT_EQ(msg, "");
  EXPECT_EQ(read_text(dir / "rel.txt"), "x");
}

TEST(AtomicFile, MissingDirectoryIsAnErrorNamingThePath) {
  TempDir dir;
  const auto p = dir / "no_such_dir" / "model.safetensors";
  const std::string msg = testing::error_of([&] { write_file_atomic(p, std::string_view("x")); });
  EXPECT_NE(msg.find("[ckpt] cannot write '" + p.string() + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the directory '" + (dir / "no_such_dir").string() + "' does not exist"),
            std::string::npos)
      << msg;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{});
}

TEST(AtomicFile, FailedRenameRemovesTheTempAndKeepsTheTarget) {
  // A directory in the way: the temp is written, the rename over the directory fails (EISDIR).
  TempDir dir;
  const auto p = dir / "iter_0000100";
  std::filesystem::create_directory(p);
  EXPECT_ERROR_HAS(
      write_file_atomic(p, std::string_view("x")),
      "renaming the temp '" + temp_path_for(p).string() + "' over it failed: Is a directory");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"iter_0000100"});
  EXPECT_TRUE(std::filesystem::is_directory(p));
}

// A writer killed inside write_file_atomic (a forked child, MOECORE_FAULT_KILL_AFTER_BYTES:
// SIGKILL once that many bytes of the file are written) before any byte, halfway and with every
// byte written but not yet renamed: the target keeps its old content whole each time, and the
// dead writer's temp holds what it had written, so the kill did land in the middle of the write.
// The next write replaces the target; the dead writers' temps are debris nothing reads.
TEST(AtomicFile, HalfWrittenTempNeverReplacesTheTarget) {
  TempDir dir;
  const auto p = dir / "latest_checkpointed_iteration.txt";
  write_file_atomic(p, std::string_view("100"));
  const std::string next = "200000";
  std::vector<std::string> entries = {"latest_checkpointed_iteration.txt"};
  for (const int kill_at : {0, 3, 6}) {
    SCOPED_TRACE("killed after " + std::to_string(kill_at) + " bytes");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // the writer that crashes; _exit: no gtest teardown in the child
      ::setenv("MOECORE_FAULT_KILL_AFTER_BYTES", std::to_string(kill_at).c_str(), 1);
      try {
        write_file_atomic(p, std::string_view(next));
      } catch (...) {
      }
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the writer was not killed by the hook: status " << status;
    EXPECT_EQ(read_text(p), "100");
    const std::string tmp = "latest_checkpointed_iteration.txt.tmp." + std::to_string(pid);
    EXPECT_EQ(read_text(dir / tmp), next.substr(0, kill_at));
    entries.push_back(tmp);
    std::sort(entries.begin(), entries.end());
    EXPECT_EQ(dir.entries(), entries);
  }
  write_file_atomic(p, std::string_view("300"));
  EXPECT_EQ(read_text(p), "300");
  EXPECT_EQ(dir.entries(), entries);
}

// A temp of this very process left by an earlier crash (the pid reused, or a retry after a
// failed save) is truncated by the next write, not appended to or partly kept.
TEST(AtomicFile, StaleTempOfThisProcessIsTruncated) {
  TempDir dir;
  const auto p = dir / "latest_checkpointed_iteration.txt";
  write_file_atomic(p, std::string_view("100"));
  const auto tmp = write_temp_only(p, as_bytes(std::string("2000000000")));
  EXPECT_EQ(tmp, temp_path_for(p));
  EXPECT_EQ(read_text(p), "100");
  write_file_atomic(p, std::string_view("3"));
  EXPECT_EQ(read_text(p), "3");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"latest_checkpointed_iteration.txt"});
}

TEST(AtomicFile, FsyncErrorsNameThePath) {
  TempDir dir;
  const auto p = dir / "missing.safetensors";
  EXPECT_ERROR_HAS(fsync_file(p), "[ckpt] cannot fsync '" + p.string() + "'");
  EXPECT_ERROR_HAS(fsync_file(p), "No such file or directory");
  EXPECT_ERROR_HAS(fsync_dir(dir / "missing_dir"),
                   "cannot fsync the directory '" + (dir / "missing_dir").string() + "'");
  write_file_atomic(p, std::string_view("x"));
  EXPECT_NO_THROW(fsync_file(p));
  EXPECT_NO_THROW(fsync_dir(dir.path()));
  EXPECT_ERROR_HAS(fsync_dir(p), "Not a directory");  // a file is not a directory
}

}  // namespace
}  // namespace moecore::ckpt
