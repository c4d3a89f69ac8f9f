// Plain-loop f32 <-> bf16 conversion: the oracle for cast.cpp, element by element through the
// scalar helpers of core/dtype.h (round to nearest even, NaN kept quiet with its sign).
#include "core/check.h"
#include "ops/cast.h"

namespace moecore::ops {

void cast_f32_to_bf16_ref(bf16* y, const float* x, int64_t n) {
  MOE_CHECK(n >= 0, "[cast_ref] n={} < 0", n);
  for (int64_t i = 0; i < n; ++i) y[i] = float_to_bf16(x[i]);
}

void cast_bf16_to_f32_ref(float* y, const bf16* x, int64_t n) {
  MOE_CHECK(n >= 0, "[cast_ref] n={} < 0", n);
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_float(x[i]);
}

void round_f32_to_bf16_ref(float* y, const float* x, int64_t n) {
  MOE_CHECK(n >= 0, "[cast_ref] n={} < 0", n);
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_float(float_to_bf16(x[i]));
}

}  // namespace moecore::ops
