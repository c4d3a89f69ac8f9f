// Element types. f32 is the working type, bf16 the reduced-precision storage type, f64 the
// type of reference computations and finite-difference gradient checks.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace moecore {

enum class DType : uint8_t { F32, BF16, F64, I32, I64 };

// bfloat16 stored as its 16 raw bits; conversion from f32 rounds to nearest even and keeps NaN.
struct bf16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN, sign kept
  }
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding) >> 16)};
}

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
  }
  return "?";
}

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::F64; };
template <> struct DTypeOf<bf16> { static constexpr DType value = DType::BF16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::I32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::I64; };

}  // namespace moecore
