// Atomic file replacement: the target holds the old content or the new, never a torn mix; no
// temp survives a write, failed or not; a temp left by a crash before the rename never
// replaces the target and the next write overwrites it; every failure names the path.
#include <gtest/gtest.h>

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

TEST(AtomicFile, HalfWrittenTempNeverReplacesTheTarget) {
  TempDir dir;
  const auto p = dir / "latest_checkpointed_iteration.txt";
  write_file_atomic(p, std::string_view("100"));
  // A crash while writing "200000": half of it in the temp, no rename.
  const std::string next = "200000";
  const auto tmp = write_temp_only(p, as_bytes(next).first(3));
  EXPECT_EQ(tmp, temp_path_for(p));
  EXPECT_EQ(read_text(p), "100");
  EXPECT_EQ(read_text(tmp), "200");
  // The next save (same pid, e.g. a retry) truncates the stale temp and replaces the target.
  write_file_atomic(p, std::string_view(next));
  EXPECT_EQ(read_text(p), "200000");
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
