// exp for softmax-like rows (attention, cross entropy, SwiGLU's sigmoid). std::exp(float) is a
// scalar libm call (-ffast-math would be needed for the vector one); this Cephes-style version
// (x = n ln2 + r, degree-6 polynomial on |r| <= ln2/2) is within 2 ulp of exp for x in [-87, 88]
// (measured over every float there: 1.02 ulp; clamped outside, so exp(-inf) is ~1e-38, not 0;
// tests/ops/test_fast_exp.cpp) and vectorises under `omp simd` with GCC 12 at -O3.
// n = round(x / ln2) comes from the 1.5 * 2^23 shifter, not std::floor: GCC 12 does not vectorise
// floorf without -fno-trapping-math, so the earlier floor(x / ln2 + 0.5) left every loop that
// called fast_exp scalar. The two roundings differ only at exact halves (16 inputs of [-87, 88],
// where either n gives |r| <= ln2/2), so the results are the same to the bit elsewhere.
// The double overload keeps std::exp: it serves references and gradient checks.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace moecore::ops {

#pragma omp declare simd notinbranch
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);  // keep 2^n a normal float
  // t = x / ln2 + 1.5 * 2^23 rounds x / ln2 to the nearest integer n in t's low mantissa bits.
  constexpr float kShift = 12582912.0f;
  const float t = x * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  float r = x - n * 0.693359375f;  // ln2 split in two so n * hi is exact
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n: n + 127 into the exponent field (n is t's integer bits less the shifter's).
  const int32_t bits =
      (std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}
inline double fast_exp(double x) { return std::exp(x); }

}  // namespace moecore::ops
