// AdamW: a single step worked by hand on three elements, fast vs reference over several steps
// (serial and OpenMP sizes, f32 and f64 params), the bf16 copy written in the same pass,
// decoupled weight decay on/off, grad_scale, and invalid hyper-parameters.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/adamw.h"
#include "ops/cast.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::Guarded;
using moecore::testing::kF32Atol;
using moecore::testing::kF32Rtol;
using moecore::testing::random_vec;

TEST(AdamW, HandComputedFirstStep) {
  // Step 1 from m = v = 0: m = (1-b1) g, v = (1-b2) g^2, bias correction gives mhat = g and
  // vhat = g^2, so the Adam direction is g / (|g| + eps) ~ sign(g).
  //   p0 =  1.0, g =  0.5 : 1.0  - 0.1 * ( 0.5/(0.5+1e-8)   + 0.01 *  1.0) = 0.899000002
  //   p1 = -2.0, g = -0.25: -2.0 - 0.1 * (-0.25/(0.25+1e-8) + 0.01 * -2.0) = -1.898000004
  //   p2 =  0.5, g =  0   : 0.5  - 0.1 * ( 0                + 0.01 *  0.5) = 0.4995
  AdamWParams a;
  AdamWStep s;
  s.lr = 0.1;
  a.weight_decay = 0.01;
  const double expect_p[3] = {0.899000002, -1.898000004, 0.4995};
  const double expect_m[3] = {0.05, -0.025, 0.0};
  const double expect_v[3] = {0.00025, 0.0000625, 0.0};
  for (bool fast : {true, false}) {
    std::vector<float> p = {1.0f, -2.0f, 0.5f}, g = {0.5f, -0.25f, 0.0f}, m(3, 0.f), v(3, 0.f);
    if (fast)
      adamw_step<float>(cpu_exec(), p.data(), g.data(), m.data(), v.data(), 3, a, &s);
    else
      adamw_step_ref<float>(p.data(), g.data(), m.data(), v.data(), 3, a, s);
    EXPECT_TRUE(all_close(p.data(), expect_p, 3, kF32Rtol, 0.0)) << "p, fast=" << fast;
    EXPECT_TRUE(all_close(m.data(), expect_m, 3, kF32Rtol, 0.0)) << "m, fast=" << fast;
    EXPECT_TRUE(all_close(v.data(), expect_v, 3, kF32Rtol, 0.0)) << "v, fast=" << fast;
  }
}

template <typename T>
void check_fast_vs_ref(int64_t n, double wd, double grad_scale) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " wd=" << wd << " scale=" << grad_scale);
  AdamWParams a;
  AdamWStep s;
  s.lr = 3e-3;
  a.beta2 = 0.95;
  a.weight_decay = wd;
  s.grad_scale = grad_scale;
  auto p0 = random_vec<T>(n, 1);
  Guarded<T> p(n), p_ref(n);
  Guarded<float> m(n, 0.f), v(n, 0.f), m_ref(n, 0.f), v_ref(n, 0.f);
  std::copy(p0.begin(), p0.end(), p.data());
  std::copy(p0.begin(), p0.end(), p_ref.data());
  for (int64_t step = 1; step <= 3; ++step) {
    s.step = step;
    auto g = random_vec<T>(n, 100 + static_cast<uint32_t>(step), -2.0, 2.0);
    adamw_step<T>(cpu_exec(), p.data(), g.data(), m.data(), v.data(), n, a, &s);
    adamw_step_ref<T>(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, a, s);
  }
  EXPECT_TRUE(p.intact() && m.intact() && v.intact()) << "fast path wrote outside its arrays";
  EXPECT_TRUE(p_ref.intact() && m_ref.intact() && v_ref.intact());
  // Fast works in T with folded constants, the reference in double: f32 rounding apart.
  EXPECT_TRUE(all_close(m.vec(), m_ref.vec(), kF32Rtol, kF32Atol)) << "m";
  EXPECT_TRUE(all_close(v.vec(), v_ref.vec(), kF32Rtol, kF32Atol)) << "v";
  EXPECT_TRUE(all_close(p.vec(), p_ref.vec(), kF32Rtol, kF32Atol)) << "p";
}

TEST(AdamW, FastMatchesReference) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, (int64_t{1} << 14) + 7}) {
    for (double wd : {0.0, 0.1}) {
      check_fast_vs_ref<float>(n, wd, 1.0);
      check_fast_vs_ref<double>(n, wd, 0.5);
    }
  }
}

// The bf16 copy written in the update pass is the new p rounded as cast_f32_to_bf16 rounds it,
// and writing it changes nothing else (serial and OpenMP sizes, specials in the copy's input).
TEST(AdamW, Bf16CopiesAreTheCastOfTheUpdatedValues) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{37}, (int64_t{1} << 14) + 7}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    AdamWParams a;
    AdamWStep s;
    s.lr = 3e-3;
    a.weight_decay = 0.1;
    auto p0 = random_vec<float>(n, 11);
    if (n > 1) p0[1] = 1.0f + std::ldexp(1.0f, -8);  // a bf16 rounding tie
    std::vector<float> p1 = p0, p2 = p0, m1(n, 0.f), v1(n, 0.f), m2(n, 0.f), v2(n, 0.f);
    // p3: the widened copy alone (the widened-bf16 GEMM path); p4: both copies.
    std::vector<float> p3 = p0, p4 = p0, m3(n, 0.f), v3(n, 0.f), m4(n, 0.f), v4(n, 0.f);
    Guarded<uint16_t> p16(n), p16_both(n);
    Guarded<float> p16w(n), p16w_both(n);
    std::vector<bf16> cast(n);
    std::vector<float> rounded(n);
    for (int64_t step = 1; step <= 2; ++step) {
      s.step = step;
      auto g = random_vec<float>(n, 200 + static_cast<uint32_t>(step), -2.0, 2.0);
      adamw_step<float>(cpu_exec(), p1.data(), g.data(), m1.data(), v1.data(), n, a, &s,
                        reinterpret_cast<bf16*>(p16.data()));
      adamw_step<float>(cpu_exec(), p2.data(), g.data(), m2.data(), v2.data(), n, a, &s);
      adamw_step<float>(cpu_exec(), p3.data(), g.data(), m3.data(), v3.data(), n, a, &s, nullptr,
                        p16w.data());
      adamw_step<float>(cpu_exec(), p4.data(), g.data(), m4.data(), v4.data(), n, a, &s,
                        reinterpret_cast<bf16*>(p16_both.data()), p16w_both.data());
      for (const auto* q : {&p1, &p3, &p4}) {
        EXPECT_EQ(0, std::memcmp(q->data(), p2.data(), n * sizeof(float)));
      }
      for (const auto* q : {&m1, &m3, &m4}) {
        EXPECT_EQ(0, std::memcmp(q->data(), m2.data(), n * sizeof(float)));
      }
      for (const auto* q : {&v1, &v3, &v4}) {
        EXPECT_EQ(0, std::memcmp(q->data(), v2.data(), n * sizeof(float)));
      }
      cast_f32_to_bf16_ref(cast.data(), p1.data(), n);
      round_f32_to_bf16_ref(rounded.data(), p1.data(), n);
      EXPECT_EQ(0, std::memcmp(p16.data(), cast.data(), n * sizeof(bf16)));
      EXPECT_EQ(0, std::memcmp(p16_both.data(), cast.data(), n * sizeof(bf16)));
      EXPECT_EQ(0, std::memcmp(p16w.data(), rounded.data(), n * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(p16w_both.data(), rounded.data(), n * sizeof(float)));
      EXPECT_TRUE(p16.intact() && p16_both.intact() && p16w.intact() && p16w_both.intact());
    }
  }
  // f64 parameters keep no bf16 copy.
  double p = 1.0, g = 1.0;
  float m = 0.f, v = 0.f;
  bf16 p16;
  const AdamWStep one;
  EXPECT_THROW(adamw_step<double>(cpu_exec(), &p, &g, &m, &v, 1, AdamWParams{}, &one, &p16),
               moecore::Error);
  float p16w;
  EXPECT_THROW(
      adamw_step<double>(cpu_exec(), &p, &g, &m, &v, 1, AdamWParams{}, &one, nullptr, &p16w),
      moecore::Error);
}

// The widened copy is written with streaming stores from its first 16-byte boundary on (scalar
// stores before it and after the last whole block): at every alignment and length it holds the
// rounded update, the values around it untouched, p equal to the update without a copy.
TEST(AdamW, WidenedCopyIsExactAtEveryAlignment) {
  AdamWParams a;
  AdamWStep s;
  s.lr = 3e-3;
  a.weight_decay = 0.1;
  for (int64_t n : {int64_t{3}, int64_t{16}, int64_t{53}, (int64_t{1} << 14) + 9}) {
    for (int64_t offset = 0; offset < 4; ++offset) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << offset << " floats");
      const auto p0 = random_vec<float>(n, 31);
      const auto g = random_vec<float>(n, 32, -2.0, 2.0);
      std::vector<float> p_plain = p0, m_plain(n, 0.f), v_plain(n, 0.f);
      std::vector<float> p = p0, m(n, 0.f), v(n, 0.f);
      alignas(64) static float buf[(int64_t{1} << 14) + 32];
      std::fill(std::begin(buf), std::end(buf), -7.f);
      float* p16w = buf + offset;
      for (int64_t step = 1; step <= 2; ++step) {
        s.step = step;
        adamw_step<float>(cpu_exec(), p_plain.data(), g.data(), m_plain.data(), v_plain.data(), n,
                          a, &s);
        adamw_step<float>(cpu_exec(), p.data(), g.data(), m.data(), v.data(), n, a, &s, nullptr,
                          p16w);
      }
      EXPECT_EQ(0, std::memcmp(p.data(), p_plain.data(), n * sizeof(float)));
      std::vector<float> rounded(n);
      round_f32_to_bf16_ref(rounded.data(), p_plain.data(), n);
      EXPECT_EQ(0, std::memcmp(p16w, rounded.data(), n * sizeof(float)));
      for (int64_t i = 0; i < offset; ++i) EXPECT_EQ(buf[i], -7.f) << "before, " << i;
      for (int64_t i = offset + n; i < static_cast<int64_t>(std::size(buf)); ++i)
        ASSERT_EQ(buf[i], -7.f) << "after, " << i;
    }
  }
}

TEST(AdamW, WeightDecayIsDecoupled) {
  // Zero gradient: m = v = 0, so the Adam term vanishes and only the decay acts:
  // wd = 0 leaves p bitwise alone, wd > 0 shrinks it by exactly lr * wd * p.
  AdamWParams a;
  AdamWStep s;
  s.lr = 0.1;
  std::vector<float> g(4, 0.f);
  for (double wd : {0.0, 0.5}) {
    a.weight_decay = wd;
    for (bool fast : {true, false}) {
      std::vector<float> p = {1.f, -2.f, 0.25f, 8.f}, m(4, 0.f), v(4, 0.f);
      const std::vector<float> p0 = p;
      if (fast)
        adamw_step<float>(cpu_exec(), p.data(), g.data(), m.data(), v.data(), 4, a, &s);
      else
        adamw_step_ref<float>(p.data(), g.data(), m.data(), v.data(), 4, a, s);
      for (int i = 0; i < 4; ++i) {
        EXPECT_FLOAT_EQ(p[i], p0[i] * static_cast<float>(1.0 - s.lr * wd))
            << "wd=" << wd << " fast=" << fast << " i=" << i;
      }
      if (wd == 0.0) {
        EXPECT_EQ(0, std::memcmp(p.data(), p0.data(), 4 * sizeof(float)));
      }
    }
  }
}

TEST(AdamW, GradScaleEqualsPrescaledGradient) {
  // Scaling by a power of two is exact, so both forms must agree bitwise.
  AdamWParams a;
  AdamWStep s;
  a.weight_decay = 0.1;
  auto g = random_vec<float>(37, 5), p0 = random_vec<float>(37, 6);
  std::vector<float> g_half(g);
  for (auto& x : g_half) x *= 0.5f;
  std::vector<float> p1 = p0, p2 = p0, m1(37, 0.f), v1(37, 0.f), m2(37, 0.f), v2(37, 0.f);
  s.grad_scale = 0.5;
  adamw_step<float>(cpu_exec(), p1.data(), g.data(), m1.data(), v1.data(), 37, a, &s);
  s.grad_scale = 1.0;
  adamw_step<float>(cpu_exec(), p2.data(), g_half.data(), m2.data(), v2.data(), 37, a, &s);
  EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), m1.size() * sizeof(float)));
}

TEST(AdamW, InvalidHyperParametersAreErrors) {
  float p = 1.f, g = 1.f, m = 0.f, v = 0.f;
  AdamWParams a;
  AdamWStep s;
  s.step = 0;
  EXPECT_THROW(adamw_step<float>(cpu_exec(), &p, &g, &m, &v, 1, a, &s), moecore::Error);
  a = AdamWParams{};
  s = AdamWStep{};
  a.beta2 = 1.0;
  EXPECT_THROW(adamw_step_ref<float>(&p, &g, &m, &v, 1, a, s), moecore::Error);
  a = AdamWParams{};
  s = AdamWStep{};
  a.eps = 0.0;
  EXPECT_THROW(adamw_step<float>(cpu_exec(), &p, &g, &m, &v, 1, a, &s), moecore::Error);
}

}  // namespace
}  // namespace moecore::ops
