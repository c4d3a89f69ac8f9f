// Crash-safe file replacement for checkpoints: a file is written to a temp beside it, flushed to
// disk, renamed over the target and the directory flushed, so after a crash the path holds
// either the old content or the new, never a torn mix. Failures name the path and the errno.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <span>
#include <string_view>

namespace moecore::ckpt {

// The temp that write_file_atomic uses for `path`: "<path>.tmp.<pid>". Same directory, so the
// rename never crosses a filesystem; the pid keeps two processes writing one path from sharing
// a temp (two threads of one process must not write the same path at once).
std::filesystem::path temp_path_for(const std::filesystem::path& path);

// Writes `data` to temp_path_for(path), fsyncs it, renames it over `path` and fsyncs the
// directory. On any failure the temp is removed and moecore::Error names the path. Test hook:
// MOECORE_FAULT_KILL_AFTER_BYTES=N in the environment kills the process (SIGKILL) once N bytes of
// the temp are written, before the rename (a crash in the middle of a write).
void write_file_atomic(const std::filesystem::path& path, std::span<const std::byte> data);
void write_file_atomic(const std::filesystem::path& path, std::string_view text);
// The concatenation of `pieces` (a safetensors header and its data block, without first
// copying them into one buffer).
void write_file_atomic(const std::filesystem::path& path,
                       std::span<const std::span<const std::byte>> pieces);

// Where a streamed file's bytes go: called with each next piece, in order.
using ByteSink = std::function<void(std::span<const std::byte>)>;
// The bytes that `produce` passes to its sink, in order (a shard streamed tensor by tensor from
// where the values live, through a bounded buffer: no copy of the whole file in memory).
// Everything else as above, the kill hook included.
void write_file_atomic_streamed(const std::filesystem::path& path,
                                const std::function<void(const ByteSink&)>& produce);

// The first half of write_file_atomic alone: writes and fsyncs temp_path_for(path), leaves it
// there and returns its path, without touching `path`. This is the temp a crash before the
// rename leaves under this process's pid, for the tests that show a reader ignores it and that
// the next write_file_atomic of this process truncates it (a crash inside write_file_atomic
// itself is MOECORE_FAULT_KILL_AFTER_BYTES's).
std::filesystem::path write_temp_only(const std::filesystem::path& path,
                                      std::span<const std::byte> data);

// fsync of a regular file's content, and of a directory's entries (which is what makes a
// rename or a newly created file in it durable).
void fsync_file(const std::filesystem::path& path);
void fsync_dir(const std::filesystem::path& dir);

}  // namespace moecore::ckpt
