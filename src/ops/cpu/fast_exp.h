// exp for softmax-like rows (attention, cross entropy). std::exp(float) is a scalar libm call
// (-ffast-math would be needed for the vector one) and cost a quarter of the attention's run
// time; this Cephes-style version (x = n ln2 + r, degree-6 polynomial on |r| <= ln2/2) is within
// 2 ulp for x in [-87, 88] (clamped outside, so exp(-inf) is ~1e-38, not 0) and vectorises under
// `omp simd`. The double overload keeps std::exp: it serves references and gradient checks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace moecore::ops {

#pragma omp declare simd notinbranch
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);  // keep 2^n a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;  // ln2 split in two so n * hi is exact
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline double fast_exp(double x) { return std::exp(x); }

}  // namespace moecore::ops
