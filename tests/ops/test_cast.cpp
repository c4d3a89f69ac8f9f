// f32 <-> bf16 casts: round-to-nearest-even on hand-built ties, NaN/inf/overflow/denormals,
// fast == reference bitwise (serial and OpenMP sizes), an exhaustive bf16 -> f32 -> bf16 round
// trip, and the f32 -> bf16 -> f32 relative error bound.
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/testing.h"
#include "ops/cast.h"

namespace moecore::ops {
namespace {

using moecore::testing::Guarded;
using moecore::testing::kBf16Rtol;
using moecore::testing::random_vec;

float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}
bf16* as_bf16(uint16_t* p) {
  return reinterpret_cast<bf16*>(p);
}

struct Case {
  uint32_t f32_bits;
  uint16_t bf16_bits;
  const char* why;
};

// Expected bits worked out by hand: bf16 keeps the top 16 bits; the low 16 decide rounding.
const Case kCases[] = {
    {0x3f800000u, 0x3f80, "1.0 exact"},
    {0x3f808000u, 0x3f80, "tie, kept bit even: round down"},
    {0x3f818000u, 0x3f82, "tie, kept bit odd: round up to even"},
    {0x3f808001u, 0x3f81, "just above the tie: up"},
    {0x3f807fffu, 0x3f80, "just below the tie: down"},
    {0xbf808000u, 0xbf80, "negative tie, even: magnitude down"},
    {0xbf818000u, 0xbf82, "negative tie, odd: magnitude up"},
    {0x3fffffffu, 0x4000, "carry into the exponent"},
    {0x7f7fffffu, 0x7f80, "FLT_MAX rounds to +inf"},
    {0x7f800000u, 0x7f80, "+inf"},
    {0xff800000u, 0xff80, "-inf"},
    {0x7fc00000u, 0x7fc0, "quiet NaN"},
    {0x7f800001u, 0x7fc0, "signalling NaN whose payload is only in the low bits stays NaN"},
    {0xff800001u, 0xffc0, "negative NaN keeps its sign"},
    {0x7fffffffu, 0x7fff, "NaN with all-ones payload does not round into inf or wrap"},
    {0x00000000u, 0x0000, "+0"},
    {0x80000000u, 0x8000, "-0 keeps its sign"},
    {0x00000001u, 0x0000, "smallest denormal rounds to 0"},
    {0x00018000u, 0x0002, "denormal tie, odd: up (denormals are not flushed)"},
    {0x00008000u, 0x0000, "denormal tie, even: down"},
};

TEST(Cast, RoundToNearestEvenAndSpecialValues) {
  for (const Case& c : kCases) {
    float x = from_bits(c.f32_bits);
    bf16 fast, ref;
    cast_f32_to_bf16(cpu_exec(), &fast, &x, 1);
    cast_f32_to_bf16_ref(&ref, &x, 1);
    EXPECT_EQ(ref.bits, c.bf16_bits) << c.why << std::hex << " input 0x" << c.f32_bits;
    EXPECT_EQ(fast.bits, c.bf16_bits) << c.why << std::hex << " input 0x" << c.f32_bits;
  }
}

// Fast == reference bitwise, below and above the OpenMP threshold, with specials mixed in.
TEST(Cast, FastMatchesReferenceBitwise) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, (int64_t{1} << 16) + 3}) {
    auto x = random_vec<float>(n, 7, -1e3, 1e3);
    for (int64_t i = 0; i < n && i < int64_t(std::size(kCases)); ++i) {
      x[i * 3 % n] = from_bits(kCases[i].f32_bits);
    }
    // Guarded<bf16> does not compile (bf16 has no operator==), so guard the raw bits.
    Guarded<uint16_t> y(n), y_ref(n);
    cast_f32_to_bf16(cpu_exec(), as_bf16(y.data()), x.data(), n);
    cast_f32_to_bf16_ref(as_bf16(y_ref.data()), x.data(), n);
    EXPECT_TRUE(y.intact() && y_ref.intact()) << "n=" << n;
    EXPECT_EQ(0, std::memcmp(y.data(), y_ref.data(), n * sizeof(bf16))) << "n=" << n;

    Guarded<float> back(n), back_ref(n);
    cast_bf16_to_f32(cpu_exec(), back.data(), as_bf16(y.data()), n);
    cast_bf16_to_f32_ref(back_ref.data(), as_bf16(y.data()), n);
    EXPECT_TRUE(back.intact() && back_ref.intact()) << "n=" << n;
    EXPECT_EQ(0, std::memcmp(back.data(), back_ref.data(), n * sizeof(float))) << "n=" << n;
  }
}

// round_f32_to_bf16 (the widened-bf16 GEMM inputs) == the reference bitwise, and == widening
// the cast, in place too.
TEST(Cast, RoundToBf16InF32MatchesCastThenWiden) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, (int64_t{1} << 16) + 3}) {
    auto x = random_vec<float>(n, 8, -1e3, 1e3);
    for (int64_t i = 0; i < n && i < int64_t(std::size(kCases)); ++i) {
      x[i * 3 % n] = from_bits(kCases[i].f32_bits);
    }
    Guarded<float> y(n), y_ref(n), widened(n);
    std::vector<bf16> x16(n);
    round_f32_to_bf16(cpu_exec(), y.data(), x.data(), n);
    round_f32_to_bf16_ref(y_ref.data(), x.data(), n);
    cast_f32_to_bf16_ref(x16.data(), x.data(), n);
    cast_bf16_to_f32_ref(widened.data(), x16.data(), n);
    EXPECT_TRUE(y.intact() && y_ref.intact()) << "n=" << n;
    EXPECT_EQ(0, std::memcmp(y.data(), y_ref.data(), n * sizeof(float))) << "n=" << n;
    EXPECT_EQ(0, std::memcmp(y.data(), widened.data(), n * sizeof(float))) << "n=" << n;
    round_f32_to_bf16(cpu_exec(), x.data(), x.data(), n);
    EXPECT_EQ(0, std::memcmp(x.data(), widened.data(), n * sizeof(float))) << "n=" << n;
  }
}

TEST(Cast, Bf16ToF32ToBf16IsIdentityForAllPatterns) {
  // bf16 -> f32 is exact, so the way back must reproduce every non-NaN pattern.
  const int64_t n = 1 << 16;
  std::vector<bf16> x(n), y(n);
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) x[i].bits = static_cast<uint16_t>(i);
  cast_bf16_to_f32(cpu_exec(), f.data(), x.data(), n);
  cast_f32_to_bf16(cpu_exec(), y.data(), f.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(f[i])) {
      ASSERT_TRUE(std::isnan(bf16_to_float(y[i]))) << std::hex << "pattern 0x" << i;
      ASSERT_EQ(y[i].bits & 0x8000, x[i].bits & 0x8000) << "NaN sign, pattern 0x" << i;
    } else {
      ASSERT_EQ(y[i].bits, x[i].bits) << std::hex << "pattern 0x" << i;
    }
  }
}

TEST(Cast, RoundTripRelativeErrorBound) {
  // bf16 keeps 8 significant bits, so round-to-nearest errs by at most half an ulp: 2^-8
  // relative (a tie just above a power of two comes within a hair of it).
  auto x = random_vec<float>(4096, 3, -100.0, 100.0);
  std::vector<bf16> y(x.size());
  std::vector<float> back(x.size());
  cast_f32_to_bf16(cpu_exec(), y.data(), x.data(), x.size());
  cast_bf16_to_f32(cpu_exec(), back.data(), y.data(), x.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double rel = std::abs(double(back[i]) - double(x[i])) / std::abs(double(x[i]));
    worst = std::max(worst, rel);
  }
  EXPECT_LE(worst, kBf16Rtol);
  EXPECT_GT(worst, kBf16Rtol / 4) << "bound should be nearly attained on 4096 random values";
}

}  // namespace
}  // namespace moecore::ops
