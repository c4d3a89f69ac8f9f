// RoPE: fast (cached tables) vs reference (angles from base) in f32 and f64 with guard bytes,
// in-place use, the non-interleaved convention on hand-computed values, norm preservation per
// pair, position 0 is the identity, backward inverts forward, fp64 finite differences, errors.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/rope.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::check_gradient;
using moecore::testing::Guarded;
using moecore::testing::random_vec;

struct RopeShape {
  int64_t n_tok, n_heads, D;
  double base;
};

// D = 2 (one pair), odd token and head counts, D = 128, Llama-3's base 500000, and one
// shape above the size where the fast path goes multi-threaded.
const RopeShape kShapes[] = {
    {1, 1, 2, 10000.0},    {7, 3, 8, 10000.0},    {33, 2, 16, 10000.0},
    {5, 4, 128, 500000.0}, {300, 4, 32, 10000.0},
};
constexpr int64_t kMaxPos = 4096;

std::vector<int32_t> random_positions(int64_t n, uint32_t seed) {
  std::vector<int32_t> pos(n);
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, kMaxPos - 1);
  for (auto& p : pos) p = d(gen);
  if (n > 1) pos[0] = 0, pos[n - 1] = kMaxPos - 1;  // both ends of the table
  return pos;
}

std::string name(const RopeShape& s) {
  return "n_tok=" + std::to_string(s.n_tok) + " n_heads=" + std::to_string(s.n_heads) +
         " D=" + std::to_string(s.D) + " base=" + std::to_string(s.base);
}

template <typename T>
void fast_matches_ref(double rtol, double atol) {
  uint32_t seed = 1;
  for (const RopeShape& s : kShapes) {
    SCOPED_TRACE(name(s));
    const RopeTables cache(kMaxPos, s.D, s.base);
    const int64_t n = s.n_tok * s.n_heads * s.D;
    const std::vector<T> x = random_vec<T>(n, seed += 3);
    const std::vector<int32_t> pos = random_positions(s.n_tok, seed);
    Guarded<T> y(n), y_ref(n), dx(n), dx_ref(n);
    rope_forward<T>(cpu_exec(), y.data(), x.data(), pos.data(), s.n_tok, s.n_heads, cache);
    rope_forward_ref<T>(y_ref.data(), x.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
    rope_backward<T>(cpu_exec(), dx.data(), x.data(), pos.data(), s.n_tok, s.n_heads, cache);
    rope_backward_ref<T>(dx_ref.data(), x.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
    EXPECT_TRUE(y.intact() && y_ref.intact() && dx.intact() && dx_ref.intact());
    EXPECT_TRUE(all_close(y.data(), y_ref.data(), n, rtol, atol)) << "forward";
    EXPECT_TRUE(all_close(dx.data(), dx_ref.data(), n, rtol, atol)) << "backward";

    // In place (y aliases x) gives the same result as out of place, for all four functions.
    std::vector<T> buf = x;
    rope_forward<T>(cpu_exec(), buf.data(), buf.data(), pos.data(), s.n_tok, s.n_heads, cache);
    EXPECT_TRUE(all_close(buf.data(), y.data(), n, 0, 0)) << "forward in place";
    buf = x;
    rope_forward_ref<T>(buf.data(), buf.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
    EXPECT_TRUE(all_close(buf.data(), y_ref.data(), n, 0, 0)) << "forward_ref in place";
    buf = x;
    rope_backward<T>(cpu_exec(), buf.data(), buf.data(), pos.data(), s.n_tok, s.n_heads, cache);
    EXPECT_TRUE(all_close(buf.data(), dx.data(), n, 0, 0)) << "backward in place";
    buf = x;
    rope_backward_ref<T>(buf.data(), buf.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
    EXPECT_TRUE(all_close(buf.data(), dx_ref.data(), n, 0, 0)) << "backward_ref in place";
  }
}

TEST(Rope, FastMatchesRefF32) {
  fast_matches_ref<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol);
}

TEST(Rope, FastMatchesRefF64) {
  fast_matches_ref<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol);
}

// Pins the convention: pairs are (x[i], x[i + D/2]) (not interleaved (x[2i], x[2i+1])), the
// rotation is y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, pair i turns at base^(-2i/D).
TEST(Rope, NonInterleavedConventionByHand) {
  const double base = 100.0;  // D = 4: pair 0 at angle p, pair 1 at angle p * 100^(-1/2)
  const RopeTables cache(8, 4, base);
  const int32_t pos[1] = {3};
  const double x[4] = {1.0, 2.0, 0.5, -1.0};  // pairs (1, 0.5) and (2, -1)
  const double a0 = 3.0, a1 = 0.3;
  const double expect[4] = {
      1.0 * std::cos(a0) - 0.5 * std::sin(a0), 2.0 * std::cos(a1) + 1.0 * std::sin(a1),
      0.5 * std::cos(a0) + 1.0 * std::sin(a0), -1.0 * std::cos(a1) + 2.0 * std::sin(a1)};
  double y[4], y_ref[4];
  rope_forward<double>(cpu_exec(), y, x, pos, 1, 1, cache);
  rope_forward_ref<double>(y_ref, x, pos, 1, 1, 4, base);
  EXPECT_TRUE(all_close(y, expect, 4, 1e-14, 1e-14));
  EXPECT_TRUE(all_close(y_ref, expect, 4, 1e-14, 1e-14));
}

TEST(Rope, PreservesNormPerPair) {
  const RopeShape s{9, 3, 16, 10000.0};
  const RopeTables cache(kMaxPos, s.D, s.base);
  const int64_t n = s.n_tok * s.n_heads * s.D, half = s.D / 2;
  const std::vector<double> x = random_vec<double>(n, 11);
  const std::vector<int32_t> pos = random_positions(s.n_tok, 12);
  std::vector<double> y(n);
  rope_forward<double>(cpu_exec(), y.data(), x.data(), pos.data(), s.n_tok, s.n_heads, cache);
  for (int64_t row = 0; row < s.n_tok * s.n_heads; ++row) {
    for (int64_t i = 0; i < half; ++i) {
      const double* xr = x.data() + row * s.D;
      const double* yr = y.data() + row * s.D;
      const double nx = xr[i] * xr[i] + xr[i + half] * xr[i + half];
      const double ny = yr[i] * yr[i] + yr[i + half] * yr[i + half];
      EXPECT_NEAR(ny, nx, 1e-14) << "row " << row << " pair " << i;
    }
  }
}

// cos 0 = 1 and sin 0 = 0 exactly, so position 0 must return x bit for bit.
template <typename T>
void position_zero_is_identity() {
  const RopeShape s{5, 2, 8, 10000.0};
  const RopeTables cache(16, s.D, s.base);
  const int64_t n = s.n_tok * s.n_heads * s.D;
  const std::vector<T> x = random_vec<T>(n, 21);
  const std::vector<int32_t> pos(s.n_tok, 0);
  std::vector<T> y(n), y_ref(n), dx(n);
  rope_forward<T>(cpu_exec(), y.data(), x.data(), pos.data(), s.n_tok, s.n_heads, cache);
  rope_forward_ref<T>(y_ref.data(), x.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
  rope_backward<T>(cpu_exec(), dx.data(), x.data(), pos.data(), s.n_tok, s.n_heads, cache);
  EXPECT_TRUE(all_close(y, x, 0, 0));
  EXPECT_TRUE(all_close(y_ref, x, 0, 0));
  EXPECT_TRUE(all_close(dx, x, 0, 0));
}

TEST(Rope, PositionZeroIsIdentityF32) {
  position_zero_is_identity<float>();
}
TEST(Rope, PositionZeroIsIdentityF64) {
  position_zero_is_identity<double>();
}

// The backward is the inverse rotation: backward(forward(x)) == x up to rounding.
template <typename T>
void backward_inverts_forward(double rtol, double atol) {
  const RopeShape s{17, 3, 32, 10000.0};
  const RopeTables cache(kMaxPos, s.D, s.base);
  const int64_t n = s.n_tok * s.n_heads * s.D;
  const std::vector<T> x = random_vec<T>(n, 31);
  const std::vector<int32_t> pos = random_positions(s.n_tok, 32);
  std::vector<T> buf = x, buf_ref = x;
  rope_forward<T>(cpu_exec(), buf.data(), buf.data(), pos.data(), s.n_tok, s.n_heads, cache);
  rope_backward<T>(cpu_exec(), buf.data(), buf.data(), pos.data(), s.n_tok, s.n_heads, cache);
  rope_forward_ref<T>(buf_ref.data(), buf_ref.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
  rope_backward_ref<T>(buf_ref.data(), buf_ref.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
  EXPECT_TRUE(all_close(buf, x, rtol, atol)) << "fast";
  EXPECT_TRUE(all_close(buf_ref, x, rtol, atol)) << "ref";
}

TEST(Rope, BackwardInvertsForwardF32) {
  backward_inverts_forward<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol);
}
TEST(Rope, BackwardInvertsForwardF64) {
  backward_inverts_forward<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol);
}

// loss = sum(rope(x) * R): dL/dx = rope_backward(cpu_exec(), R), against fp64 central differences.
TEST(Rope, BackwardMatchesFiniteDifferences) {
  const RopeShape s{6, 2, 8, 10000.0};
  const RopeTables cache(64, s.D, s.base);
  const int64_t n = s.n_tok * s.n_heads * s.D;
  std::vector<double> x = random_vec<double>(n, 41);
  const std::vector<double> R = random_vec<double>(n, 42);
  const std::vector<int32_t> pos = {0, 1, 5, 17, 63, 2};
  std::vector<double> y(n), dx(n), dx_ref(n);
  auto loss = [&]() {
    rope_forward_ref<double>(y.data(), x.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) acc += y[i] * R[i];
    return acc;
  };
  rope_backward<double>(cpu_exec(), dx.data(), R.data(), pos.data(), s.n_tok, s.n_heads, cache);
  rope_backward_ref<double>(dx_ref.data(), R.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), n, "dx fast", n));
  EXPECT_TRUE(check_gradient(loss, x.data(), dx_ref.data(), n, "dx ref", n));
}

TEST(Rope, RejectsBadArguments) {
  EXPECT_THROW(RopeTables(16, 7, 10000.0), moecore::Error);  // odd D
  EXPECT_THROW(RopeTables(0, 8, 10000.0), moecore::Error);
  EXPECT_THROW(RopeTables(16, 8, 0.0), moecore::Error);
  const RopeTables cache(16, 8, 10000.0);
  std::vector<float> x(2 * 8, 1.0f);
  const int32_t past_end[2] = {3, 16}, negative[2] = {-1, 0};
  EXPECT_THROW(rope_forward<float>(cpu_exec(), x.data(), x.data(), past_end, 2, 1, cache),
               moecore::Error);
  EXPECT_THROW(rope_backward<float>(cpu_exec(), x.data(), x.data(), negative, 2, 1, cache),
               moecore::Error);
  EXPECT_THROW(rope_forward_ref<float>(x.data(), x.data(), negative, 2, 1, 8, 10000.0),
               moecore::Error);
  EXPECT_THROW(rope_forward_ref<float>(x.data(), x.data(), past_end, 2, 1, 7, 10000.0),
               moecore::Error);
  EXPECT_THROW(rope_forward<float>(cpu_exec(), x.data(), x.data(), past_end, 2, 1, RopeCache{}),
               moecore::Error);
}

}  // namespace
}  // namespace moecore::ops
