// Helpers of the checkpoint tests: a fresh directory per test, whole-file reads and writes, and
// the assertion that an error names what it should.
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

}  // namespace moecore::ckpt::testing

#define EXPECT_ERROR_HAS(stmt, needle)                                            \
  do {                                                                            \
    const std::string msg_ = ::moecore::testing::error_of([&] { stmt; });   \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "error: '" << msg_ << "'"; \
  } while (0)
