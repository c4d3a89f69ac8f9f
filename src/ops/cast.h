// Conversions between f32 and bf16 (round to nearest even).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace moecore::ops {

void cast_f32_to_bf16(bf16* y, const float* x, int64_t n);
void cast_f32_to_bf16_ref(bf16* y, const float* x, int64_t n);
void cast_bf16_to_f32(float* y, const bf16* x, int64_t n);
void cast_bf16_to_f32_ref(float* y, const bf16* x, int64_t n);

}  // namespace moecore::ops
