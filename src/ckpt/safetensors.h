// The safetensors format (HuggingFace): an 8-byte little-endian header length N, N bytes of JSON
// header naming each tensor's dtype, shape and [begin, end) byte range in the data block that
// follows, optionally "__metadata__" (string to string). What the writer and the reader share:
// the dtype table and the per-tensor record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace moecore::ckpt {

// The reserved header key of the string-to-string metadata; no tensor may be named so.
inline constexpr std::string_view kSafetensorsMetadataKey = "__metadata__";
// The reference implementation refuses larger headers (HeaderTooLarge); so do we, so that every
// file moecore accepts, the reference library (and so HuggingFace tooling) accepts too.
inline constexpr uint64_t kSafetensorsMaxHeader = 100'000'000;

// Bytes per element of a safetensors dtype string ("F32" -> 4, "BF16" -> 2, "BOOL" -> 1).
// The sub-byte dtypes (F4, F6_E2M3, F6_E3M2) and unknown strings throw, naming the known ones.
size_t dtype_size(std::string_view dtype);
bool is_known_dtype(std::string_view dtype);
// "BOOL, U8, I8, ...": for messages.
std::string known_dtypes();

// The safetensors name of a moecore element type (DType::BF16 -> "BF16").
std::string_view safetensors_dtype(DType t);

// One tensor of a file. offset is relative to the start of the data block, as in the header.
struct TensorInfo {
  std::string dtype;
  std::vector<int64_t> shape;  // [] is a scalar (1 element); a 0 anywhere makes 0 elements
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};

// prod(shape) * elem_size, or nullopt when a dimension is negative or the product overflows
// 64 bits (a corrupt header must fail on the check, not wrap around and pass it).
std::optional<uint64_t> checked_nbytes(const std::vector<int64_t>& shape, size_t elem_size);

// "[2, 3]", for messages.
std::string format_shape(const std::vector<int64_t>& shape);

}  // namespace moecore::ckpt
