// What every fuzz target shares: a scratch directory for the parsers that take a path (the input
// is written to a file there), and the rule that moecore::Error, a check that names the fault,
// is a clean rejection. Anything else that escapes a target (another exception, a crash, a
// sanitizer report, a leak, a timeout) is a finding: libFuzzer stops and saves the input.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace moecore::fuzz {

// libFuzzer leaves through _Exit (no atexit handlers run), so each process names its directory
// by its pid and removes those of processes that are gone; a running target's is left alone.
inline void remove_stale_scratch(const std::filesystem::path& base) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("moecore_fuzz.")) continue;
    const long pid = std::strtol(name.c_str() + 13, nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::filesystem::remove_all(e.path(), ec);
    }
  }
}

// The directory of this process. In /dev/shm where there is one: rewriting a file on a disk
// file system (ext4 with discard) per input made the file-reading targets 13x slower.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const bool shm = ::access("/dev/shm", W_OK) == 0;
    const std::filesystem::path base =
        shm ? std::filesystem::path("/dev/shm") : std::filesystem::temp_directory_path();
    remove_stale_scratch(base);
    const std::filesystem::path d = base / ("moecore_fuzz." + std::to_string(::getpid()));
    std::error_code ec;
    std::filesystem::remove_all(d, ec);  // a dead process's with this pid
    if (!std::filesystem::create_directories(d, ec)) {
      std::fprintf(stderr, "[fuzz] cannot create %s: %s\n", d.c_str(), ec.message().c_str());
      std::abort();
    }
    return d;
  }();
  return dir;
}

// Writes bytes to `path` (replacing it).
inline void write_path(const std::string& path, const void* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror("[fuzz] writing the input file");
    std::abort();
  }
}

// Writes bytes to scratch_dir()/name and returns the path.
inline std::string write_file(const std::string& name, const void* data, size_t size) {
  const std::string path = (scratch_dir() / name).string();
  write_path(path, data, size);
  return path;
}

inline std::string write_file(const std::string& name, std::string_view text) {
  return write_file(name, text.data(), text.size());
}

inline void remove_file(const std::string& name) {
  std::error_code ec;
  std::filesystem::remove(scratch_dir() / name, ec);
}

// A property of an accepted input that does not hold: a finding like a crash, with the message.
[[noreturn]] inline void violated(const char* what) {
  std::fprintf(stderr, "[fuzz] property violated: %s\n", what);
  std::abort();
}

}  // namespace moecore::fuzz

#define FUZZ_EXPECT(cond)                                            \
  do {                                                               \
    if (!(cond)) ::moecore::fuzz::violated(#cond " (" __FILE__ ")"); \
  } while (0)
