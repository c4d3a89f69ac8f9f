// fast_exp's contract (ops/cpu/fast_exp.h): within 2 ulp of exp on [-87, 88], clamped outside,
// exact at 0, and the vectorised loop computes bit for bit what the scalar call does (so a
// value does not depend on whether it fell in a loop's vector body or its remainder).
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "ops/cpu/fast_exp.h"

namespace moecore::ops {
namespace {

// |fast_exp(x) - exp(x)| in units of the last place of the correctly rounded float exp(x).
double ulp_error(float x) {
  const double ref = std::exp(static_cast<double>(x));
  const float rf = static_cast<float>(ref);
  const double ulp = static_cast<double>(std::nextafter(rf, std::numeric_limits<float>::infinity())) - rf;
  return std::fabs(static_cast<double>(fast_exp(x)) - ref) / ulp;
}

TEST(FastExp, WithinTwoUlpOnItsRange) {
  // Every 101st float of [-87, 88] (about 22 million), plus the ends and the exact halves of
  // x / ln2 where the rounding of n could go either way.
  double worst = 0;
  float worst_x = 0;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t u = 0; u < 0x42b00000u; u += 101) {  // 0x42b00000 = 88.0f
      const float x = std::bit_cast<float>(u | sign);
      if (x < -87.0f) continue;
      const double e = ulp_error(x);
      if (e > worst) worst = e, worst_x = x;
    }
  }
  for (float x : {-87.0f, 88.0f, 0.5f * 0.6931472f, -0.5f * 0.6931472f, 10.5f * 0.6931472f}) {
    const double e = ulp_error(x);
    if (e > worst) worst = e, worst_x = x;
  }
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
}

TEST(FastExp, ExactAtZeroAndClampedOutside) {
  EXPECT_EQ(fast_exp(0.0f), 1.0f);
  EXPECT_EQ(fast_exp(-0.0f), 1.0f);
  const float lo = fast_exp(-87.0f), hi = fast_exp(88.0f);
  EXPECT_EQ(fast_exp(-std::numeric_limits<float>::infinity()), lo);
  EXPECT_EQ(fast_exp(-1000.0f), lo);
  EXPECT_EQ(fast_exp(1000.0f), hi);
  EXPECT_GT(lo, 0.0f);
  EXPECT_TRUE(std::isnormal(lo));
  EXPECT_TRUE(std::isfinite(hi));
}

// Through a pointer: the scalar code, never inlined into a vector loop.
float (*volatile scalar_exp)(float) = fast_exp;

TEST(FastExp, VectorLoopEqualsScalarCallsBitwise) {
  // An odd length, so the loop has a vector body and a remainder.
  const int64_t n = 1000 + 13;
  auto x = moecore::testing::random_vec<float>(n, 17, -90.0, 90.0);
  x[3] = -std::numeric_limits<float>::infinity();
  x[4] = 0.0f;
  std::vector<float> y(n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = fast_exp(x[i]);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(y[i]), std::bit_cast<uint32_t>(scalar_exp(x[i])))
        << "x[" << i << "] = " << x[i];
  }
}

}  // namespace
}  // namespace moecore::ops
