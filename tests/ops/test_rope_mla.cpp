// MLA's RoPE and YaRN: the frequencies, ramp, correction range, attention factor and softmax
// scale against values worked by hand from Megatron's formulas (DeepSeek-V3's settings); the
// interleaved pairing on a hand-computed row; fast vs reference in f32 and f64 (both pairings,
// plain and YaRN, strided rows, untouched elements outside the rotary slice, guard bytes);
// fp64 finite differences of the backward; thread-count invariance; errors.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/rope_mla.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::check_gradient;
using moecore::testing::Guarded;
using moecore::testing::random_vec;
using moecore::testing::ScopedOmpThreads;

// DeepSeek-V3: qk_pos_emb_head_dim 64, base 10000, factor 40, original context 4096, betas 32
// and 1, mscale = mscale_all_dim = 1.
YarnParams deepseek_v3() {
  return YarnParams{40.0, 4096, 32.0, 1.0, 1.0, 1.0};
}

// Correction dims: 64 ln(4096 / (2 pi 32)) / (2 ln 10000) = 10.4722 -> floor 10, and
// 64 ln(4096 / (2 pi)) / (2 ln 10000) = 22.5134 -> ceil 23.
TEST(RopeYarn, CorrectionRangeByHand) {
  EXPECT_NEAR(yarn_correction_dim(32.0, 64, 10000.0, 4096), 10.472240810318025, 1e-12);
  EXPECT_NEAR(yarn_correction_dim(1.0, 64, 10000.0, 4096), 22.513440636877274, 1e-12);
  const auto [low, high] = yarn_correction_range(deepseek_v3(), 64, 10000.0);
  EXPECT_EQ(low, 10);
  EXPECT_EQ(high, 23);
  // Clamped to [0, D - 1]. D 8, base 10: original context 64 puts beta_fast's dim at
  // 8 ln(64 / (64 pi)) / (2 ln 10) = -1.99 (-> 0) and beta_slow's at 4.03 (-> 5); context 10^6
  // puts beta_slow's at 20.8 (-> 7) and beta_fast's at 14.8 (-> 14: Megatron clamps low from
  // below only).
  const auto [lo2, hi2] = yarn_correction_range(YarnParams{4.0, 64, 32.0, 1.0, 1.0, 0.0}, 8, 10.0);
  EXPECT_EQ(lo2, 0);
  EXPECT_EQ(hi2, 5);
  const auto [lo3, hi3] =
      yarn_correction_range(YarnParams{4.0, 1000000, 32.0, 1.0, 1.0, 0.0}, 8, 10.0);
  EXPECT_EQ(lo3, 14);
  EXPECT_EQ(hi3, 7);
}

TEST(RopeYarn, LinearRampByHand) {
  const std::vector<double> r = yarn_linear_ramp(10.0, 23.0, 32);
  ASSERT_EQ(r.size(), 32u);
  for (int i = 0; i <= 10; ++i) EXPECT_EQ(r[size_t(i)], 0.0) << i;
  EXPECT_DOUBLE_EQ(r[11], 1.0 / 13.0);
  EXPECT_DOUBLE_EQ(r[16], 6.0 / 13.0);
  for (int i = 23; i < 32; ++i) EXPECT_EQ(r[size_t(i)], 1.0) << i;
  // low == high: Megatron widens the ramp by 0.001 instead of dividing by zero.
  const std::vector<double> s = yarn_linear_ramp(3.0, 3.0, 5);
  EXPECT_EQ(s[3], 0.0);
  EXPECT_EQ(s[4], 1.0);
}

// Pairs below low keep base^(-2i/64); above high they are divided by 40; pair 16 (ramp 6/13)
// mixes the two: 0.01 (6/13 / 40 + 7/13) = 0.0055.
TEST(RopeYarn, FrequenciesByHand) {
  const RopeScaling yarn{RopeType::Yarn, deepseek_v3()};
  const std::vector<double> f = rope_inv_freq(64, 10000.0, yarn);
  const std::vector<double> plain = rope_inv_freq(64, 10000.0, RopeScaling{});
  ASSERT_EQ(f.size(), 32u);
  EXPECT_EQ(f[0], 1.0);
  EXPECT_DOUBLE_EQ(plain[16], 0.01);
  EXPECT_DOUBLE_EQ(f[10], std::pow(10000.0, -20.0 / 64.0));
  EXPECT_DOUBLE_EQ(f[16], 0.0055);
  EXPECT_DOUBLE_EQ(f[23], std::pow(10000.0, -46.0 / 64.0) / 40.0);
  EXPECT_DOUBLE_EQ(f[31], std::pow(10000.0, -62.0 / 64.0) / 40.0);
  for (int i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(plain[size_t(i)], std::pow(10000.0, -i / 32.0));
}

// yarn_get_mscale(40, 1) = 1 + 0.1 ln 40 = 1.3688879454113936; the cos / sin factor is the
// ratio of mscale's to mscale_all_dim's, the softmax scale the square of mscale_all_dim's over
// sqrt(128 + 64).
TEST(RopeYarn, ScalesByHand) {
  EXPECT_DOUBLE_EQ(yarn_get_mscale(40.0, 1.0), 1.3688879454113936);
  EXPECT_EQ(yarn_get_mscale(1.0, 1.0), 1.0);
  EXPECT_EQ(yarn_get_mscale(0.5, 0.707), 1.0);
  EXPECT_EQ(rope_attention_factor(RopeScaling{RopeType::Yarn, deepseek_v3()}), 1.0);
  EXPECT_DOUBLE_EQ(
      rope_attention_factor(RopeScaling{RopeType::Yarn, YarnParams{40.0, 4096, 32, 1, 1.0, 0.0}}),
      1.3688879454113936);
  EXPECT_EQ(
      rope_attention_factor(RopeScaling{RopeType::Rope, YarnParams{40.0, 4096, 32, 1, 1.0, 0.0}}),
      1.0);
  // 1.3688879454113936^2 / sqrt(192): squared, not once (0.0987909779717127).
  EXPECT_DOUBLE_EQ(mla_softmax_scale(128, 64, 40.0, 1.0), 0.1352337788608801);
  EXPECT_DOUBLE_EQ(mla_softmax_scale(128, 64, 1.0, 1.0), 1.0 / std::sqrt(192.0));
  EXPECT_DOUBLE_EQ(mla_softmax_scale(128, 64, 40.0, 0.0), 1.0 / std::sqrt(192.0));
}

// Interleaved pairs (x0, x1) and (x2, x3), written [x0 c0 - x1 s0, x2 c1 - x3 s1, x1 c0 + x0 s0,
// x3 c1 + x2 s1], times the attention factor; base 100 and D 4: pair 1 turns at p / 10.
TEST(RopeMla, InterleavedConventionByHand) {
  const YarnParams yp{2.0, 1 << 20, 32.0, 1.0, 1.0, 0.0};  // factor 1 + 0.1 ln 2, no ramp effect
  RopeMlaSpec spec{4, 100.0, RopePairing::Interleaved, {RopeType::Rope, yp}};
  for (RopeType type : {RopeType::Rope, RopeType::Yarn}) {
    spec.scaling.type = type;
    SCOPED_TRACE(type == RopeType::Yarn ? "yarn" : "rope");
    // With original context 2^20 both pairs sit below low: YaRN keeps their frequencies.
    const double m = type == RopeType::Yarn ? 1.0 + 0.1 * std::log(2.0) : 1.0;
    const RopeMlaTables cache(8, spec);
    const int32_t pos[1] = {3};
    const double x[4] = {1.0, 0.5, 2.0, -1.0};
    const double a0 = 3.0, a1 = 0.3;
    const double expect[4] = {m * (1.0 * std::cos(a0) - 0.5 * std::sin(a0)),
                              m * (2.0 * std::cos(a1) + 1.0 * std::sin(a1)),
                              m * (0.5 * std::cos(a0) + 1.0 * std::sin(a0)),
                              m * (-1.0 * std::cos(a1) + 2.0 * std::sin(a1))};
    double y[4], y_ref[4];
    rope_mla_forward<double>(cpu_exec(), y, x, pos, 1, 1, 4, 4, cache);
    rope_mla_forward_ref<double>(y_ref, x, pos, 1, 1, 4, 4, spec);
    EXPECT_TRUE(all_close(y, expect, 4, 1e-14, 1e-14));
    EXPECT_TRUE(all_close(y_ref, expect, 4, 1e-14, 1e-14));
  }
}

struct Case {
  int64_t n_tok, n_heads, D, ldx, ldy;
  RopePairing pairing;
  RopeType type;
};

std::string name(const Case& c) {
  return "n_tok=" + std::to_string(c.n_tok) + " n_heads=" + std::to_string(c.n_heads) +
         " D=" + std::to_string(c.D) + " ldx=" + std::to_string(c.ldx) +
         " ldy=" + std::to_string(c.ldy) +
         (c.pairing == RopePairing::Interleaved ? " interleaved" : " half-split") +
         (c.type == RopeType::Yarn ? " yarn" : " rope");
}

// One pair; odd counts and strides wider than D on either side; MLA's 64-wide slice of a
// 192-wide head; a shape above the threading threshold.
const Case kCases[] = {
    {1, 1, 2, 2, 2, RopePairing::Interleaved, RopeType::Rope},
    {7, 3, 8, 8, 11, RopePairing::Interleaved, RopeType::Yarn},
    {9, 2, 16, 21, 16, RopePairing::HalfSplit, RopeType::Yarn},
    {5, 4, 64, 192, 192, RopePairing::Interleaved, RopeType::Yarn},
    {300, 4, 32, 40, 32, RopePairing::Interleaved, RopeType::Rope},
    {200, 3, 64, 64, 70, RopePairing::HalfSplit, RopeType::Rope},
};
constexpr int64_t kMaxPos = 2048;

RopeMlaSpec spec_of(const Case& c) {
  // Original context 256 within the 2048-long table: the ramp falls inside the pairs.
  return RopeMlaSpec{c.D, 10000.0, c.pairing, {c.type, YarnParams{8.0, 256, 32.0, 1.0, 1.0, 0.5}}};
}

std::vector<int32_t> positions(int64_t n, uint32_t seed) {
  std::vector<int32_t> pos(static_cast<size_t>(n));
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, kMaxPos - 1);
  for (auto& p : pos) p = d(gen);
  if (n > 1) pos[0] = 0, pos[size_t(n - 1)] = kMaxPos - 1;
  return pos;
}

template <typename T>
void fast_matches_ref(double rtol, double atol) {
  uint32_t seed = 5;
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    const RopeMlaSpec spec = spec_of(c);
    const RopeMlaTables cache(kMaxPos, spec);
    const int64_t rows = c.n_tok * c.n_heads, nx = rows * c.ldx, ny = rows * c.ldy;
    const std::vector<T> x = random_vec<T>(nx, seed += 3), dy = random_vec<T>(ny, seed + 1);
    const std::vector<T> y0 = random_vec<T>(ny, seed + 2), dx0 = random_vec<T>(nx, seed + 3);
    const std::vector<int32_t> pos = positions(c.n_tok, seed);
    Guarded<T> y(ny), y_ref(ny), dx(nx), dx_ref(nx);
    for (int64_t i = 0; i < ny; ++i) y[i] = y_ref[i] = y0[size_t(i)];
    for (int64_t i = 0; i < nx; ++i) dx[i] = dx_ref[i] = dx0[size_t(i)];
    rope_mla_forward<T>(cpu_exec(), y.data(), x.data(), pos.data(), c.n_tok, c.n_heads, c.ldy,
                        c.ldx, cache);
    rope_mla_forward_ref<T>(y_ref.data(), x.data(), pos.data(), c.n_tok, c.n_heads, c.ldy, c.ldx,
                            spec);
    rope_mla_backward<T>(cpu_exec(), dx.data(), dy.data(), pos.data(), c.n_tok, c.n_heads, c.ldx,
                         c.ldy, cache);
    rope_mla_backward_ref<T>(dx_ref.data(), dy.data(), pos.data(), c.n_tok, c.n_heads, c.ldx, c.ldy,
                             spec);
    EXPECT_TRUE(y.intact() && y_ref.intact() && dx.intact() && dx_ref.intact());
    EXPECT_TRUE(all_close(y.data(), y_ref.data(), ny, rtol, atol)) << "forward";
    EXPECT_TRUE(all_close(dx.data(), dx_ref.data(), nx, rtol, atol)) << "backward";
    // Outside the rotary slice of each row nothing is written.
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = c.D; j < c.ldy; ++j)
        ASSERT_EQ(y[r * c.ldy + j], y0[size_t(r * c.ldy + j)]) << "y row " << r << " col " << j;
      for (int64_t j = c.D; j < c.ldx; ++j)
        ASSERT_EQ(dx[r * c.ldx + j], dx0[size_t(r * c.ldx + j)]) << "dx row " << r << " col " << j;
    }
  }
}

TEST(RopeMla, FastMatchesRefF32) {
  fast_matches_ref<float>(moecore::testing::kF32Rtol, moecore::testing::kF32Atol);
}
TEST(RopeMla, FastMatchesRefF64) {
  fast_matches_ref<double>(moecore::testing::kF64Rtol, moecore::testing::kF64Atol);
}

// The pair norms scale by the attention factor exactly (up to rounding): a rotation times it.
TEST(RopeMla, ScalesPairNormsByTheFactor) {
  const Case c{6, 2, 16, 16, 16, RopePairing::Interleaved, RopeType::Yarn};
  const RopeMlaSpec spec = spec_of(c);
  const double m = rope_attention_factor(spec.scaling);
  EXPECT_NE(m, 1.0);
  const RopeMlaTables cache(kMaxPos, spec);
  const int64_t n = c.n_tok * c.n_heads * c.D;
  const std::vector<double> x = random_vec<double>(n, 71);
  const std::vector<int32_t> pos = positions(c.n_tok, 72);
  std::vector<double> y(n);
  rope_mla_forward<double>(cpu_exec(), y.data(), x.data(), pos.data(), c.n_tok, c.n_heads, c.D, c.D,
                           cache);
  for (int64_t r = 0; r < c.n_tok * c.n_heads; ++r) {
    for (int64_t i = 0; i < c.D / 2; ++i) {
      const double* xr = x.data() + r * c.D;
      const double* yr = y.data() + r * c.D;
      const double nx = xr[2 * i] * xr[2 * i] + xr[2 * i + 1] * xr[2 * i + 1];
      const double ny = yr[i] * yr[i] + yr[i + c.D / 2] * yr[i + c.D / 2];
      EXPECT_NEAR(ny, m * m * nx, 1e-13) << "row " << r << " pair " << i;
    }
  }
}

// loss = sum(rope(x) * R) over the rotary slices: dL/dx = rope_mla_backward(R), against fp64
// central differences, for each pairing with YaRN on and strided rows.
TEST(RopeMla, BackwardMatchesFiniteDifferences) {
  for (RopePairing pairing : {RopePairing::Interleaved, RopePairing::HalfSplit}) {
    const Case c{5, 2, 8, 11, 9, pairing, RopeType::Yarn};
    SCOPED_TRACE(name(c));
    RopeMlaSpec spec = spec_of(c);
    spec.scaling.yarn.original_max_position_embeddings = 16;  // the ramp inside 4 pairs
    const RopeMlaTables cache(64, spec);
    const int64_t rows = c.n_tok * c.n_heads, nx = rows * c.ldx, ny = rows * c.ldy;
    std::vector<double> x = random_vec<double>(nx, 41);
    const std::vector<double> R = random_vec<double>(ny, 42);
    const std::vector<int32_t> pos = {0, 1, 5, 63, 17};
    std::vector<double> y(ny, 0.0), dx(nx, 0.0), dx_ref(nx, 0.0);
    auto loss = [&]() {
      rope_mla_forward_ref<double>(y.data(), x.data(), pos.data(), c.n_tok, c.n_heads, c.ldy, c.ldx,
                                   spec);
      double acc = 0.0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < c.D; ++j) acc += y[r * c.ldy + j] * R[r * c.ldy + j];
      return acc;
    };
    rope_mla_backward<double>(cpu_exec(), dx.data(), R.data(), pos.data(), c.n_tok, c.n_heads,
                              c.ldx, c.ldy, cache);
    rope_mla_backward_ref<double>(dx_ref.data(), R.data(), pos.data(), c.n_tok, c.n_heads, c.ldx,
                                  c.ldy, spec);
    EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), nx, "dx fast", nx));
    EXPECT_TRUE(check_gradient(loss, x.data(), dx_ref.data(), nx, "dx ref", nx));
  }
}

TEST(RopeMla, ThreadCountInvariantBitwise) {
  const Case c{400, 4, 64, 192, 192, RopePairing::Interleaved, RopeType::Yarn};
  const RopeMlaSpec spec = spec_of(c);
  const RopeMlaTables cache(kMaxPos, spec);
  const int64_t n = c.n_tok * c.n_heads * c.ldx;
  const std::vector<float> x = random_vec<float>(n, 81), dy = random_vec<float>(n, 82);
  const std::vector<int32_t> pos = positions(c.n_tok, 83);
  auto run = [&](int threads, std::vector<float>& y, std::vector<float>& dx) {
    ScopedOmpThreads scoped(threads);
    y.assign(size_t(n), 0.0f), dx.assign(size_t(n), 0.0f);
    rope_mla_forward<float>(cpu_exec(), y.data(), x.data(), pos.data(), c.n_tok, c.n_heads, c.ldy,
                            c.ldx, cache);
    rope_mla_backward<float>(cpu_exec(), dx.data(), dy.data(), pos.data(), c.n_tok, c.n_heads,
                             c.ldx, c.ldy, cache);
  };
  std::vector<float> y1, dx1;
  run(1, y1, dx1);
  for (int threads : {2, 3}) {
    std::vector<float> y, dx;
    run(threads, y, dx);
    EXPECT_TRUE(all_close(y, y1, 0, 0)) << threads << " threads";
    EXPECT_TRUE(all_close(dx, dx1, 0, 0)) << threads << " threads";
  }
}

TEST(RopeMla, RejectsBadArguments) {
  RopeMlaSpec spec{7, 10000.0, RopePairing::Interleaved, {}};
  EXPECT_THROW(RopeMlaTables(16, spec), moecore::Error);  // odd D
  spec.D = 8;
  EXPECT_THROW(RopeMlaTables(0, spec), moecore::Error);
  spec.base = 0.0;
  EXPECT_THROW(RopeMlaTables(16, spec), moecore::Error);
  spec.base = 10000.0;
  spec.scaling = {RopeType::Yarn, YarnParams{0.0, 4096, 32, 1, 1, 0}};
  EXPECT_THROW(RopeMlaTables(16, spec), moecore::Error);  // factor 0
  spec.scaling = {};
  const RopeMlaTables cache(16, spec);
  std::vector<float> x(2 * 8, 1.0f), y(2 * 8, 0.0f);
  const int32_t past_end[2] = {3, 16}, ok[2] = {0, 1};
  EXPECT_THROW(rope_mla_forward<float>(cpu_exec(), y.data(), x.data(), past_end, 2, 1, 8, 8, cache),
               moecore::Error);
  EXPECT_THROW(rope_mla_forward<float>(cpu_exec(), x.data(), x.data(), ok, 2, 1, 8, 8, cache),
               moecore::Error);  // in place
  EXPECT_THROW(rope_mla_forward<float>(cpu_exec(), y.data(), x.data(), ok, 2, 1, 8, 4, cache),
               moecore::Error);  // stride below D
  EXPECT_THROW(
      rope_mla_backward<float>(cpu_exec(), y.data(), x.data(), ok, 2, 1, 8, 8, RopeMlaCache{}),
      moecore::Error);
}

}  // namespace
}  // namespace moecore::ops
