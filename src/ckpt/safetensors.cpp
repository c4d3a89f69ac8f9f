#include "ckpt/safetensors.h"

#include <array>
#include <utility>

#include "core/check.h"

namespace moecore::ckpt {
namespace {

// Every byte-sized dtype of the reference implementation's Dtype enum, in its order (increasing
// alignment, which is how the reference writer orders tensors: the largest first).
constexpr std::array<std::pair<std::string_view, size_t>, 17> kDtypes = {{
    // clang-format off
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
    {"F32", 4},  {"C64", 8}, {"F64", 8}, {"I64", 8},     {"U64", 8},
    // clang-format on
}};

}  // namespace

bool is_known_dtype(std::string_view dtype) {
  for (const auto& [name, size] : kDtypes) {
    if (name == dtype) return true;
  }
  return false;
}

std::string known_dtypes() {
  std::string s;
  for (const auto& [name, size] : kDtypes) {
    if (!s.empty()) s += ", ";
    s += name;
  }
  return s;
}

size_t dtype_size(std::string_view dtype) {
  for (const auto& [name, size] : kDtypes) {
    if (name == dtype) return size;
  }
  // Packed below a byte: a tensor's size is not numel * a whole number of bytes.
  MOE_CHECK(dtype != "F4" && dtype != "F6_E2M3" && dtype != "F6_E3M2",
            "[safetensors] dtype '{}' packs elements below a byte: not supported", dtype);
  MOE_FAIL("[safetensors] unknown dtype '{}' (known: {})", dtype, known_dtypes());
}

std::string_view safetensors_dtype(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  MOE_FAIL("[safetensors] DType {} has no safetensors name", static_cast<int>(t));
}

std::optional<uint64_t> checked_nbytes(const std::vector<int64_t>& shape, size_t elem_size) {
  uint64_t n = elem_size;
  for (const int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace moecore::ckpt
