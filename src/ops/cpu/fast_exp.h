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
// fast_exp16 is the same polynomial on 16 lanes of AVX-512, for kernels written in intrinsics
// (GCC 12 leaves `omp simd` loops over fast_exp scalar when they also reduce into a double); it
// rounds n as floor(x / ln2 + 0.5), which differs from the shifter only at exact halves.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
// GCC 12.2 warns "'__Y' may be used uninitialized" inside the unmasked AVX-512 intrinsics (their
// _mm512_undefined_ps() pass-through, GCC bug 105593, fixed in 12.3): silence it for the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

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

#if defined(__AVX512F__)
// Same range reduction and coefficients as fast_exp(float) (FMA-contracted), same accuracy;
// 2^n applied with scalef.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace moecore::ops
