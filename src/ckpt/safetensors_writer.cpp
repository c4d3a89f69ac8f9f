#include "ckpt/safetensors_writer.h"

#include <nlohmann/json.hpp>

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

void SafetensorsWriter::add(std::string name, std::string dtype, std::vector<int64_t> shape,
                            std::span<const std::byte> bytes) {
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
  const std::optional<uint64_t> nbytes = checked_nbytes(shape, dtype_size(dtype));
  MOE_CHECK(nbytes.has_value(), "[safetensors] tensor '{}': shape {} x {} overflows 64 bits", name,
            format_shape(shape), dtype);
  MOE_CHECK(*nbytes == bytes.size(),
            "[safetensors] tensor '{}': {} bytes given, but shape {} of {} ({} bytes each) "
            "needs {}",
            name, bytes.size(), format_shape(shape), dtype, dtype_size(dtype), *nbytes);
  const uint64_t begin = data_.size();
  data_.insert(data_.end(), bytes.begin(), bytes.end());
  names_.insert(name);
  tensors_.push_back({std::move(name), std::move(dtype), std::move(shape), begin, data_.size()});
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

std::vector<std::byte> SafetensorsWriter::serialize() const {
  const std::string h = header();
  std::vector<std::byte> out(8 + h.size() + data_.size());
  const std::array<std::byte, 8> len = le64(h.size());
  std::memcpy(out.data(), len.data(), len.size());
  std::memcpy(out.data() + 8, h.data(), h.size());
  if (!data_.empty()) std::memcpy(out.data() + 8 + h.size(), data_.data(), data_.size());
  return out;
}

void SafetensorsWriter::write(const std::filesystem::path& path) const {
  const std::string h = header();
  const std::array<std::byte, 8> len = le64(h.size());
  const std::span<const std::byte> pieces[] = {
      std::span<const std::byte>(len), std::as_bytes(std::span<const char>(h.data(), h.size())),
      std::span<const std::byte>(data_)};
  write_file_atomic(path, pieces);
}

}  // namespace moecore::ckpt
