#include "ckpt/safetensors_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include "core/check.h"

namespace moecore::ckpt {
namespace {

using Json = nlohmann::ordered_json;  // keeps header order: the tie-break among empty tensors

// One tensor entry as the header gives it, before the tiling check.
struct Entry {
  std::string name;
  TensorInfo info;
  uint64_t end = 0;
};

}  // namespace

FileBytes read_file_bytes(const std::filesystem::path& file) {
  const std::string path = file.string();
  FileBytes out;
  std::unique_ptr<std::byte[]>& buf = out.data;
  size_t& size = out.size;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    MOE_FAIL("[safetensors] cannot open '{}': {}", path, std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_FAIL("[safetensors] '{}' is not a regular file (a directory, device or pipe?)", path);
  }
  size = static_cast<size_t>(st.st_size);
  buf.reset(new std::byte[size]);  // default-initialised: no memset of what read() overwrites
  size_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(fd, buf.get() + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      MOE_FAIL("[safetensors] reading '{}' failed after {} of {} bytes: {}", path, got, size,
               n == 0 ? "the file shrank while being read" : std::strerror(err));
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

namespace {

void parse_metadata(const std::string& path, const Json& m,
                    std::map<std::string, std::string>& out) {
  MOE_CHECK(m.is_object(),
            "[safetensors] '{}': \"__metadata__\" is a JSON {}, expected an object of strings",
            path, m.type_name());
  for (const auto& [k, v] : m.items()) {
    MOE_CHECK(v.is_string(),
              "[safetensors] '{}': \"__metadata__\" entry '{}' is a JSON {}, "
              "expected a string (metadata maps strings to strings)",
              path, k, v.type_name());
    out[k] = v.get<std::string>();
  }
}

// Everything about one entry that does not depend on the others.
Entry parse_entry(const std::string& path, const std::string& name, const Json& e,
                  uint64_t data_size) {
  MOE_CHECK(e.is_object(),
            "[safetensors] '{}': tensor '{}' is a JSON {}, expected an object "
            "with dtype, shape and data_offsets",
            path, name, e.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    MOE_CHECK(e.contains(key),
              "[safetensors] '{}': tensor '{}' has no \"{}\" (every tensor "
              "entry needs dtype, shape and data_offsets)",
              path, name, key);
  }
  Entry out;
  out.name = name;

  const Json& dtype = e["dtype"];
  MOE_CHECK(dtype.is_string(),
            "[safetensors] '{}': tensor '{}': \"dtype\" is a JSON {}, "
            "expected a string such as \"F32\"",
            path, name, dtype.type_name());
  out.info.dtype = dtype.get<std::string>();
  MOE_CHECK(is_known_dtype(out.info.dtype),
            "[safetensors] '{}': tensor '{}': unknown dtype '{}' (known: {})", path, name,
            out.info.dtype, known_dtypes());

  const Json& shape = e["shape"];
  MOE_CHECK(shape.is_array(),
            "[safetensors] '{}': tensor '{}': \"shape\" is a JSON {}, expected "
            "an array of dimensions",
            path, name, shape.type_name());
  for (size_t i = 0; i < shape.size(); ++i) {
    const Json& d = shape[i];
    MOE_CHECK(d.is_number_integer(),
              "[safetensors] '{}': tensor '{}': shape {} has {} at index "
              "{}, expected a non-negative integer",
              path, name, shape.dump(), d.dump(), i);
    MOE_CHECK(!d.is_number_unsigned() ||
                  d.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
              "[safetensors] '{}': tensor '{}': shape {} dimension {} is {}, beyond int64", path,
              name, shape.dump(), i, d.dump());
    const int64_t v = d.get<int64_t>();
    MOE_CHECK(v >= 0,
              "[safetensors] '{}': tensor '{}': shape {} has the negative dimension {} "
              "at index {}, expected >= 0",
              path, name, shape.dump(), v, i);
    out.info.shape.push_back(v);
  }

  const Json& off = e["data_offsets"];
  MOE_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                off[1].is_number_unsigned(),
            "[safetensors] '{}': tensor '{}': data_offsets is {}, expected [begin, end], two "
            "non-negative integers",
            path, name, off.dump());
  const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  MOE_CHECK(begin <= end,
            "[safetensors] '{}': tensor '{}': data_offsets [{}, {}] end before they begin", path,
            name, begin, end);

  const size_t elem = dtype_size(out.info.dtype);
  const std::optional<uint64_t> nbytes = checked_nbytes(out.info.shape, elem);
  MOE_CHECK(nbytes.has_value(),
            "[safetensors] '{}': tensor '{}': shape {} x {} ({} bytes each) overflows 64 bits",
            path, name, format_shape(out.info.shape), out.info.dtype, elem);
  MOE_CHECK(end - begin == *nbytes,
            "[safetensors] '{}': tensor '{}': data_offsets [{}, {}] hold "
            "{} bytes, but shape {} of {} ({} bytes each) needs {}",
            path, name, begin, end, end - begin, format_shape(out.info.shape), out.info.dtype, elem,
            *nbytes);
  MOE_CHECK(end <= data_size,
            "[safetensors] '{}': tensor '{}': data_offsets [{}, {}] run past "
            "the end of the {}-byte data block, by {} bytes (truncated file?)",
            path, name, begin, end, data_size, end - data_size);
  out.info.offset = begin;
  out.info.nbytes = *nbytes;
  out.end = end;
  return out;
}

// The tensors, in offset order, must cover [0, data_size) exactly once: a gap or a tail is
// bytes no tensor owns (a writer bug or a mixed-up file), an overlap two tensors sharing bytes.
void check_tiling(const std::string& path, const std::vector<Entry>& sorted, uint64_t data_size) {
  uint64_t pos = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : sorted) {
    MOE_CHECK(e.info.offset >= pos,
              "[safetensors] '{}': tensor '{}' data_offsets [{}, {}] "
              "overlap tensor '{}' [{}, {}] by {} bytes: each byte of the data block belongs to "
              "one tensor",
              path, e.name, e.info.offset, e.end, prev->name, prev->info.offset, prev->end,
              pos - e.info.offset);
    MOE_CHECK(e.info.offset == pos,
              "[safetensors] '{}': gap: bytes [{}, {}) of the data block "
              "belong to no tensor: tensor '{}' begins at {}, expected {} ({})",
              path, pos, e.info.offset, e.name, e.info.offset, pos,
              prev ? fmt::format("where '{}' ends", prev->name)
                   : std::string("the start of the data block"));
    pos = e.end;
    prev = &e;
  }
  MOE_CHECK(pos == data_size,
            "[safetensors] '{}': trailing bytes: the data block is {} bytes but "
            "its tensors end at {}: {} bytes belong to no tensor",
            path, data_size, pos, data_size - pos);
}

}  // namespace

uint64_t safetensors_header_length(const std::string& path, std::span<const std::byte> first8,
                                   uint64_t file_size) {
  MOE_CHECK(file_size >= 8 && first8.size() >= 8,
            "[safetensors] '{}' is {} bytes, shorter than the 8-byte header "
            "length a safetensors file starts with (truncated, or not a safetensors file)",
            path, file_size);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(first8[i]) << (8 * i);
  MOE_CHECK(n <= file_size - 8,
            "[safetensors] '{}': header length {} runs past the end of the "
            "file ({} bytes, so at most {}): truncated, or not a safetensors file",
            path, n, file_size, file_size - 8);
  MOE_CHECK(n <= kSafetensorsMaxHeader,
            "[safetensors] '{}': header length {} exceeds the "
            "reference implementation's limit of {} bytes",
            path, n, kSafetensorsMaxHeader);
  return n;
}

SafetensorsHeader parse_safetensors_header(const std::string& path, std::string_view text,
                                           uint64_t file_size) {
  const uint64_t n = text.size();
  MOE_CHECK(!text.empty() && text[0] == '{',
            "[safetensors] '{}': the {}-byte header does not "
            "start with '{{' ({}): not a safetensors file",
            path, n,
            text.empty() ? std::string("it is empty")
                         : fmt::format("first byte 0x{:02x}", static_cast<uint8_t>(text[0])));
  SafetensorsHeader out;
  out.data_start = 8 + n;
  const uint64_t data_size = file_size - out.data_start;

  // Duplicate names: a JSON parser keeps one of the two entries silently, so they are caught
  // while parsing (depth 1 = the keys of the top-level object).
  std::set<std::string, std::less<>> seen;
  std::string duplicate;
  const Json::parser_callback_t on_key = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text, on_key);
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL("[safetensors] '{}': the {}-byte header is not valid JSON: {}", path, n, e.what());
  }
  MOE_CHECK(header.is_object(),
            "[safetensors] '{}': the header is a JSON {}, expected an object of tensors", path,
            header.type_name());
  MOE_CHECK(duplicate.empty(),
            "[safetensors] '{}': tensor '{}' appears twice in the header: names must be unique",
            path, duplicate);

  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kSafetensorsMetadataKey) {
      parse_metadata(path, value, out.metadata);
    } else {
      entries.push_back(parse_entry(path, key, value, data_size));
    }
  }
  // As the reference reader: by (begin, end); stable, so empty tensors at one offset keep the
  // header's order.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::pair(a.info.offset, a.end) < std::pair(b.info.offset, b.end);
  });
  check_tiling(path, entries, data_size);

  for (Entry& e : entries) {
    out.names.push_back(e.name);
    out.infos.emplace(std::move(e.name), std::move(e.info));
  }
  return out;
}

const TensorInfo& SafetensorsHeader::info(const std::string& path, std::string_view name) const {
  const auto it = infos.find(name);
  if (it == infos.end()) {
    std::string listed;
    if (names.size() <= 8) {
      for (const std::string& s : names) listed += (listed.empty() ? ": '" : ", '") + s + "'";
    }
    MOE_FAIL("[safetensors] '{}' has no tensor '{}' (the file has {} tensors{})", path, name,
             names.size(), listed);
  }
  return it->second;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : SafetensorsFile(path, read_file_bytes(path)) {}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path, FileBytes bytes)
    : path_(path.string()), file_(std::move(bytes.data)), file_size_(bytes.size) {
  const uint64_t n = safetensors_header_length(
      path_, std::span<const std::byte>(file_.get(), std::min<size_t>(8, file_size_)), file_size_);
  header_ = parse_safetensors_header(
      path_, std::string_view(reinterpret_cast<const char*>(file_.get() + 8), n), file_size_);
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  return header_.info(path_, name);
}

std::span<const std::byte> SafetensorsFile::bytes(std::string_view name) const {
  const TensorInfo& t = info(name);
  return {file_.get() + header_.data_start + t.offset, t.nbytes};
}

}  // namespace moecore::ckpt
