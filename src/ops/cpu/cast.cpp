// Fast f32 <-> bf16 conversion: the same bit arithmetic as core/dtype.h, written branch-free
// (f32_to_bf16_bits in ops/cast.h) so the compiler vectorises it, and split over OpenMP threads
// for large tensors. Bitwise equal to the reference. We do not use AVX512-BF16's vcvtneps2bf16:
// it flushes denormal inputs to zero, which the reference (and PyTorch's CPU cast) does not.
#include <bit>
#include <cstdint>

#include "core/check.h"
#include "ops/cast.h"

namespace moecore::ops::cpu {
namespace {
// Below this a parallel region costs more (~1-2 us) than the conversion itself.
constexpr int64_t kParallelMin = int64_t{1} << 16;
}  // namespace

void cast_f32_to_bf16(bf16* y, const float* x, int64_t n) {
  MOE_CHECK(n >= 0, "[cast] n={} < 0", n);
  static_assert(sizeof(bf16) == sizeof(uint16_t), "bf16 must be its 16 raw bits");
  uint16_t* y16 = reinterpret_cast<uint16_t*>(y);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y16[i] = f32_to_bf16_bits(x[i]);
}

void cast_bf16_to_f32(float* y, const bf16* x, int64_t n) {
  MOE_CHECK(n >= 0, "[cast] n={} < 0", n);
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_bits_to_f32(x16[i]);
}

void round_f32_to_bf16(float* y, const float* x, int64_t n) {
  MOE_CHECK(n >= 0, "[cast] n={} < 0", n);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    y[i] = f32_bf16_rounded(x[i]);
  }
}

}  // namespace moecore::ops::cpu
