#include "data/index_cache.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string_view>

#include "core/check.h"

namespace moecore::data {

template <>
const char* npy_descr<int16_t>() { return "<i2"; }
template <>
const char* npy_descr<int32_t>() { return "<i4"; }
template <>
const char* npy_descr<int64_t>() { return "<i8"; }
template <>
const char* npy_descr<uint32_t>() { return "<u4"; }

static std::string npy_header(const char* descr, int64_t rows, int64_t cols) {
  std::string shape = cols > 0 ? fmt::format("({}, {})", rows, cols) : fmt::format("({},)", rows);
  std::string dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape);
  // numpy pads the header with spaces and a newline so the data starts at a multiple of 64.
  const size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>(dict.size() >> 8));
  return out + dict;
}

template <typename T>
void write_npy(const std::string& path, const std::vector<T>& values, int64_t rows, int64_t cols) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    MOE_CHECK(out.good(), "[data] cannot write the index cache file '{}': {} (check "
                          "--data-cache-path)", tmp, std::strerror(errno));
    const std::string h = npy_header(npy_descr<T>(), rows, cols);
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
    out.write(reinterpret_cast<const char*>(values.data()),
              static_cast<std::streamsize>(values.size() * sizeof(T)));
    MOE_CHECK(out.good(), "[data] writing '{}' failed", tmp);
  }
  // Readers never see a half-written file.
  std::filesystem::rename(tmp, path);
}

namespace {

// The shape of a header moecore (or numpy) wrote: "(rows,)" or "(rows, cols)", each a decimal
// that fits int64; anything else (three dimensions, a sign, an overflow) is not a cache file.
bool parse_npy_shape(std::string_view s, int64_t* rows, int64_t* cols) {
  auto skip_spaces = [&] {
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  };
  auto number = [&](int64_t* out) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    if (ec != std::errc() || end == s.data() || *out < 0) return false;
    s.remove_prefix(static_cast<size_t>(end - s.data()));
    return true;
  };
  *cols = 0;
  if (!number(rows)) return false;
  skip_spaces();
  if (s.empty() || s.front() != ',') return false;
  s.remove_prefix(1);
  skip_spaces();
  if (!s.empty() && s.front() == ')') return true;  // "(rows,)"
  if (!number(cols)) return false;
  skip_spaces();
  return !s.empty() && s.front() == ')' && *cols > 0;
}

}  // namespace

template <typename T>
std::optional<std::vector<T>> read_npy(const std::string& path, int64_t* rows, int64_t* cols) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in.good()) return std::nullopt;
  const std::streamoff file_size = in.tellg();
  in.seekg(0);
  std::string head(10, '\0');
  in.read(head.data(), 10);
  MOE_CHECK(in.good() && head.compare(0, 6, "\x93NUMPY") == 0 && head[6] == 1,
            "[data] index cache file '{}' is not a version-1 .npy file: delete it to rebuild",
            path);
  const size_t hlen = static_cast<uint8_t>(head[8]) | (static_cast<uint8_t>(head[9]) << 8);
  std::string dict(hlen, '\0');
  in.read(dict.data(), static_cast<std::streamsize>(hlen));
  const std::string want = fmt::format("'descr': '{}', 'fortran_order': False,", npy_descr<T>());
  MOE_CHECK(in.good() && dict.find(want) != std::string::npos,
            "[data] index cache file '{}' has header {} but {} was expected: delete it to rebuild",
            path, dict, want);
  const size_t s = dict.find("'shape': (");
  int64_t r = 0, c = 0;
  MOE_CHECK(s != std::string::npos && parse_npy_shape(std::string_view(dict).substr(s + 10), &r, &c),
            "[data] index cache file '{}': no shape (rows,) or (rows, cols) in {}: delete it to "
            "rebuild",
            path, dict);
  // The data must be exactly rows * cols values: checked against the file size before anything
  // is allocated, so a corrupt shape cannot ask for terabytes.
  const uint64_t data_bytes = static_cast<uint64_t>(file_size) - 10 - hlen;
  uint64_t count = 0, bytes = 0;
  const bool fits = !__builtin_mul_overflow(static_cast<uint64_t>(r),
                                            static_cast<uint64_t>(c > 0 ? c : 1), &count) &&
                    !__builtin_mul_overflow(count, sizeof(T), &bytes);
  MOE_CHECK(fits && bytes == data_bytes,
            "[data] index cache file '{}' has {} bytes of data but its shape {} of {}-byte values "
            "needs {}: truncated or altered, delete it to rebuild",
            path, data_bytes, c > 0 ? fmt::format("({}, {})", r, c) : fmt::format("({},)", r),
            sizeof(T), fits ? fmt::format("{}", bytes) : "more than 2^64");
  *rows = r;
  *cols = c;
  std::vector<T> v(static_cast<size_t>(count));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(bytes));
  MOE_CHECK(in.gcount() == static_cast<std::streamsize>(bytes),
            "[data] index cache file '{}' is truncated: delete it to rebuild", path);
  return v;
}

template void write_npy<int16_t>(const std::string&, const std::vector<int16_t>&, int64_t, int64_t);
template void write_npy<int32_t>(const std::string&, const std::vector<int32_t>&, int64_t, int64_t);
template void write_npy<int64_t>(const std::string&, const std::vector<int64_t>&, int64_t, int64_t);
template std::optional<std::vector<int16_t>> read_npy<int16_t>(const std::string&, int64_t*, int64_t*);
template std::optional<std::vector<int32_t>> read_npy<int32_t>(const std::string&, int64_t*, int64_t*);
template std::optional<std::vector<int64_t>> read_npy<int64_t>(const std::string&, int64_t*, int64_t*);

static uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

IndexCache::IndexCache(std::string dir, const std::string& class_name, const std::string& split,
                       const std::string& description)
    : dir_(std::move(dir)), description_(description) {
  base_ = fmt::format("{:016x}-{}-{}", fnv1a(description), class_name, split);
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    MOE_CHECK(!ec && std::filesystem::is_directory(dir_),
              "[data] --data-cache-path '{}' is not a directory that can be created: {}", dir_,
              ec ? ec.message() : "it is a file");
  }
}

std::string IndexCache::path_of(const std::string& name) const {
  return (std::filesystem::path(dir_) / (base_ + "-" + name)).string();
}

bool IndexCache::hit() const {
  if (!enabled()) return false;
  std::ifstream in(path_of("description.txt"), std::ios::binary);
  if (!in.good()) return false;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text == description_;
}

void IndexCache::save_description() const {
  if (!enabled()) return;
  const std::string path = path_of("description.txt");
  std::ofstream out(path + ".tmp", std::ios::binary);
  out << description_;
  out.close();
  MOE_CHECK(out.good(), "[data] cannot write '{}' (check --data-cache-path)", path);
  std::filesystem::rename(path + ".tmp", path);
}

}  // namespace moecore::data
