#include "ckpt/safetensors_writer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstring>

#include "ckpt/atomic_file.h"
#include "ckpt/safetensors.h"
#include "core/check.h"

namespace moecore::ckpt {
namespace {

// A name the JSON header can carry: nlohmann refuses to print invalid UTF-8, and that error
// should come here, naming the tensor, not from header() later.
void check_utf8(const std::string& s, const char* what) {
  try {
    (void)nlohmann::json(s).dump();
  } catch (const nlohmann::json::exception&) {
    MOE_FAIL(
        "[safetensors] {} is not valid UTF-8 (the JSON header cannot hold it): {} bytes "
        "starting '{}'",
        what, s.size(), s.substr(0, 16));
  }
}

// The header length as the file stores it: 8 bytes, little-endian.
std::array<std::byte, 8> le64(uint64_t n) {
  std::array<std::byte, 8> b{};
  for (int i = 0; i < 8; ++i) b[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  return b;
}

}  // namespace

SafetensorsWriter::Entry& SafetensorsWriter::append(std::string name, std::string dtype,
                                                    std::vector<int64_t> shape, uint64_t nbytes) {
  MOE_CHECK(name != kSafetensorsMetadataKey,
            "[safetensors] a tensor cannot be named '{}': the header keeps that key for metadata",
            name);
  MOE_CHECK(!names_.contains(name),
            "[safetensors] tensor '{}' added twice: names in a file must be unique", name);
  check_utf8(name, "a tensor name");
  MOE_CHECK(is_known_dtype(dtype), "[safetensors] tensor '{}': unknown dtype '{}' (known: {})",
            name, dtype, known_dtypes());
  for (size_t i = 0; i < shape.size(); ++i) {
    MOE_CHECK(shape[i] >= 0,
              "[safetensors] tensor '{}': shape {} has the negative dimension {} at index {}", name,
              format_shape(shape), shape[i], i);
  }
  const std::optional<uint64_t> want = checked_nbytes(shape, dtype_size(dtype));
  MOE_CHECK(want.has_value(), "[safetensors] tensor '{}': shape {} x {} overflows 64 bits", name,
            format_shape(shape), dtype);
  MOE_CHECK(*want == nbytes,
            "[safetensors] tensor '{}': {} bytes given, but shape {} of {} ({} bytes each) "
            "needs {}",
            name, nbytes, format_shape(shape), dtype, dtype_size(dtype), *want);
  names_.insert(name);
  const uint64_t begin = data_bytes_;
  data_bytes_ += nbytes;
  tensors_.push_back(
      {std::move(name), std::move(dtype), std::move(shape), begin, data_bytes_, nullptr, nullptr});
  return tensors_.back();
}

void SafetensorsWriter::add(std::string name, std::string dtype, std::vector<int64_t> shape,
                            std::span<const std::byte> bytes) {
  Entry& e = append(std::move(name), std::move(dtype), std::move(shape), bytes.size());
  e.held.reset(new std::byte[bytes.empty() ? 1 : bytes.size()]);
  if (!bytes.empty()) std::memcpy(e.held.get(), bytes.data(), bytes.size());
}

std::span<std::byte> SafetensorsWriter::add_buffer(std::string name, std::string dtype,
                                                   std::vector<int64_t> shape) {
  const std::optional<uint64_t> n = checked_nbytes(shape, dtype_size(dtype));
  Entry& e = append(std::move(name), std::move(dtype), std::move(shape), n.value_or(~0ull));
  const size_t bytes = static_cast<size_t>(e.end - e.begin);
  e.held.reset(new std::byte[bytes > 0 ? bytes : 1]);  // uninitialised: the caller fills it
  return {e.held.get(), bytes};
}

void SafetensorsWriter::add_source(std::string name, std::string dtype, std::vector<int64_t> shape,
                                   Source source) {
  const std::optional<uint64_t> n = checked_nbytes(shape, dtype_size(dtype));
  Entry& e = append(std::move(name), std::move(dtype), std::move(shape), n.value_or(~0ull));
  e.source = std::move(source);
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  check_utf8(key, "a metadata key");
  check_utf8(value, fmt::format("the value of metadata '{}'", key).c_str());
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsWriter::header() const {
  // ordered_json keeps insertion order; the key order within an entry (dtype, shape,
  // data_offsets) and "__metadata__" first are the reference writer's, compact like serde_json.
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    h[std::string(kSafetensorsMetadataKey)] = std::move(m);
  }
  for (const Entry& e : tensors_) {
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    t["dtype"] = e.dtype;
    t["shape"] = e.shape;
    t["data_offsets"] = {e.begin, e.end};
    h[e.name] = std::move(t);
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

uint64_t SafetensorsWriter::file_bytes() const {
  return 8 + header().size() + data_bytes_;
}

void SafetensorsWriter::stream(const ByteSink& sink) const {
  const std::string h = header();
  const std::array<std::byte, 8> len = le64(h.size());
  sink(len);
  sink(std::as_bytes(std::span<const char>(h.data(), h.size())));
  size_t buffer = 0;  // the largest piece a source is asked for
  for (const Entry& e : tensors_) {
    if (e.held == nullptr)
      buffer = std::max<size_t>(buffer, std::min<uint64_t>(kStreamBuffer, e.end - e.begin));
  }
  std::unique_ptr<std::byte[]> buf(buffer > 0 ? new std::byte[buffer] : nullptr);
  for (const Entry& e : tensors_) {
    const uint64_t n = e.end - e.begin;
    if (e.held != nullptr) {
      if (n > 0) sink({e.held.get(), static_cast<size_t>(n)});
      continue;
    }
    for (uint64_t at = 0; at < n; at += buffer) {
      const std::span<std::byte> piece(buf.get(),
                                       static_cast<size_t>(std::min<uint64_t>(buffer, n - at)));
      e.source(at, piece);
      sink(piece);
    }
  }
}

std::vector<std::byte> SafetensorsWriter::serialize() const {
  std::vector<std::byte> out;
  out.reserve(static_cast<size_t>(file_bytes()));
  stream([&](std::span<const std::byte> p) { out.insert(out.end(), p.begin(), p.end()); });
  return out;
}

void SafetensorsWriter::write(const std::filesystem::path& path) const {
  write_file_atomic_streamed(path, [&](const ByteSink& sink) { stream(sink); });
}

}  // namespace moecore::ckpt
