// Element-wise MLP activations (GeLU, its tanh form, squared ReLU) with the routing probability:
// fast vs reference (with and without p), guard bytes, known values, fp64 finite differences of
// dh and dp, bitwise thread-count invariance, the bf16 forms bitwise the rounded f32 outputs, and
// SwiGLU refused.
#include <cmath>
#include <cstring>
#include <vector>

#include "common/testing.h"
#include "ops/activation.h"
#include "ops/cast.h"

namespace moecore::testing {
namespace {

using ops::Activation;

const Activation kActs[] = {Activation::GeLU, Activation::GeLUTanh, Activation::SquaredReLU};

struct Shape {
  int64_t N, F;
};
// N = 0 (an expert with no tokens), N = 1, odd N, F not a multiple of 8 or of the 16 lanes of
// dp's sum, one shape above the OpenMP threshold (2^14 elements).
const Shape kShapes[] = {{0, 5}, {1, 1}, {1, 7}, {13, 37}, {64, 300}};

template <typename T>
void compare_fast_ref(Activation act, bool with_p, double rtol, double atol) {
  for (auto [N, F] : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << ops::activation_name(act) << " N=" << N << " F=" << F << " p=" << with_p);
    auto h = random_vec<T>(N * F, 1, -6, 6);  // both tails, and exact zeros are unlikely
    auto p = random_vec<T>(N, 2, 0, 1);
    auto da = random_vec<T>(N * F, 3);
    const T* pp = with_p ? p.data() : nullptr;
    Guarded<T> a(N * F), dh(N * F), dp(N), a_r(N * F), dh_r(N * F), dp_r(N);
    ops::activation_forward<T>(cpu_exec(), act, a.data(), h.data(), pp, N, F);
    ops::activation_forward_ref(act, a_r.data(), h.data(), pp, N, F);
    ops::activation_backward<T>(cpu_exec(), act, dh.data(), dp.data(), da.data(), h.data(), pp, N,
                                F);
    ops::activation_backward_ref(act, dh_r.data(), dp_r.data(), da.data(), h.data(), pp, N, F);
    EXPECT_TRUE(all_close(a.vec(), a_r.vec(), rtol, atol)) << "a";
    EXPECT_TRUE(all_close(dh.vec(), dh_r.vec(), rtol, atol)) << "dh";
    if (with_p) {
      EXPECT_TRUE(all_close(dp.vec(), dp_r.vec(), rtol, atol)) << "dp";
    } else {
      for (int64_t n = 0; n < N; ++n) EXPECT_EQ(dp[n], T(0)) << "dp written without p";
    }
    for (auto* g : {&a, &dh, &dp, &a_r, &dh_r, &dp_r}) EXPECT_TRUE(g->intact());
  }
}

TEST(Activation, FastMatchesRefF32) {
  for (Activation act : kActs) {
    compare_fast_ref<float>(act, true, kF32Rtol, kF32Atol);
    compare_fast_ref<float>(act, false, kF32Rtol, kF32Atol);
  }
}
TEST(Activation, FastMatchesRefF64) {
  for (Activation act : kActs) {
    compare_fast_ref<double>(act, true, kF64Rtol, kF64Atol);
    compare_fast_ref<double>(act, false, kF64Rtol, kF64Atol);
  }
}

// Values worked out by hand or from the definitions: gelu(1) = 0.5 (1 + erf(1/sqrt 2)) =
// 0.8413447460685429 (the normal CDF at 1); the tanh form at 1 = 0.5 (1 + tanh(0.7978845608028654
// * 1.044715)) = 0.8411919906082768; squared ReLU of 3 and -2; every activation is 0 at 0.
TEST(Activation, KnownValues) {
  struct Case {
    Activation act;
    double x, want;
  };
  for (Case c : {Case{Activation::GeLU, 1.0, 0.8413447460685429},
                 Case{Activation::GeLU, -1.0, -1.0 + 0.8413447460685429},
                 Case{Activation::GeLUTanh, 1.0, 0.8411919906082768},
                 Case{Activation::SquaredReLU, 3.0, 9.0}, Case{Activation::SquaredReLU, -2.0, 0.0},
                 Case{Activation::GeLU, 0.0, 0.0}, Case{Activation::GeLUTanh, 0.0, 0.0},
                 Case{Activation::SquaredReLU, 0.0, 0.0}}) {
    SCOPED_TRACE(::testing::Message() << ops::activation_name(c.act) << " x=" << c.x);
    double a = 0, a_ref = 0;
    ops::activation_forward<double>(cpu_exec(), c.act, &a, &c.x, nullptr, 1, 1);
    ops::activation_forward_ref<double>(c.act, &a_ref, &c.x, nullptr, 1, 1);
    EXPECT_NEAR(a, c.want, 1e-15);
    EXPECT_NEAR(a_ref, c.want, 1e-15);
  }
}

TEST(Activation, NullProbEqualsUnitProb) {
  const int64_t N = 5, F = 11;
  auto h = random_vec<float>(N * F, 4, -3, 3);
  std::vector<float> ones(N, 1.f), a0(N * F), a1(N * F);
  for (Activation act : kActs) {
    ops::activation_forward<float>(cpu_exec(), act, a0.data(), h.data(), nullptr, N, F);
    ops::activation_forward<float>(cpu_exec(), act, a1.data(), h.data(), ones.data(), N, F);
    EXPECT_EQ(a0, a1) << ops::activation_name(act);
  }
}

TEST(Activation, RefusesSwiGlu) {
  std::vector<float> a(4), h(8);
  const std::string e = error_of([&] {
    ops::activation_forward<float>(cpu_exec(), Activation::SwiGLU, a.data(), h.data(), nullptr, 2,
                                   2);
  });
  EXPECT_NE(e.find("[activation_forward] swiglu is gated"), std::string::npos) << e;
}

// One to three threads give the same bits (the parallel shape): rows are independent and dp's
// sum has one association.
TEST(Activation, ThreadCountInvariantBitwise) {
  const int64_t N = 64, F = 300;
  auto h = random_vec<float>(N * F, 11, -6, 6);
  auto p = random_vec<float>(N, 12, 0, 1);
  auto da = random_vec<float>(N * F, 13);
  for (Activation act : kActs) {
    SCOPED_TRACE(ops::activation_name(act));
    std::vector<float> a1(N * F), dh1(N * F), dp1(N);
    {
      ScopedOmpThreads one(1);
      ops::activation_forward<float>(cpu_exec(), act, a1.data(), h.data(), p.data(), N, F);
      ops::activation_backward<float>(cpu_exec(), act, dh1.data(), dp1.data(), da.data(), h.data(),
                                      p.data(), N, F);
    }
    for (int threads : {2, 3}) {
      ScopedOmpThreads t(threads);
      std::vector<float> a(N * F), dh(N * F), dp(N);
      ops::activation_forward<float>(cpu_exec(), act, a.data(), h.data(), p.data(), N, F);
      ops::activation_backward<float>(cpu_exec(), act, dh.data(), dp.data(), da.data(), h.data(),
                                      p.data(), N, F);
      EXPECT_EQ(0, std::memcmp(a.data(), a1.data(), N * F * sizeof(float))) << threads;
      EXPECT_EQ(0, std::memcmp(dh.data(), dh1.data(), N * F * sizeof(float))) << threads;
      EXPECT_EQ(0, std::memcmp(dp.data(), dp1.data(), N * sizeof(float))) << threads;
    }
  }
}

// --bf16 outputs: bitwise the bf16 cast of the f32 fast path's outputs, their widened form
// bitwise the bf16 values widened; dp (f32) bitwise the f32 path's.
TEST(Activation, Bf16OutputsAreTheCastOfF32) {
  for (Activation act : kActs) {
    for (auto [N, F] : kShapes) {
      for (bool with_p : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << ops::activation_name(act) << " N=" << N << " F=" << F << " p=" << with_p);
        auto h = random_vec<float>(N * F, 8, -6, 6);
        auto p = random_vec<float>(N, 9, 0, 1);
        auto da = random_vec<float>(N * F, 10);
        const float* pp = with_p ? p.data() : nullptr;
        std::vector<float> a(N * F), dh(N * F), dp(N, -1.f);
        ops::activation_forward<float>(cpu_exec(), act, a.data(), h.data(), pp, N, F);
        ops::activation_backward<float>(cpu_exec(), act, dh.data(), dp.data(), da.data(), h.data(),
                                        pp, N, F);
        std::vector<bf16> a_cast(N * F), dh_cast(N * F);
        ops::cast_f32_to_bf16(cpu_exec(), a_cast.data(), a.data(), N * F);
        ops::cast_f32_to_bf16(cpu_exec(), dh_cast.data(), dh.data(), N * F);

        Guarded<uint16_t> a16(N * F), dh16(N * F);  // bf16 bits
        std::vector<float> dp16(N, -1.f), dpw(N, -1.f);
        ops::activation_forward_bf16(cpu_exec(), act, reinterpret_cast<bf16*>(a16.data()), h.data(),
                                     pp, N, F);
        ops::activation_backward_bf16(cpu_exec(), act, reinterpret_cast<bf16*>(dh16.data()),
                                      dp16.data(), da.data(), h.data(), pp, N, F);
        for (int64_t i = 0; i < N * F; ++i) ASSERT_EQ(a16[i], a_cast[i].bits) << "a " << i;
        for (int64_t i = 0; i < N * F; ++i) ASSERT_EQ(dh16[i], dh_cast[i].bits) << "dh " << i;
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(dp16[n], dp[n]) << "dp " << n;  // -1: unwritten
        EXPECT_TRUE(a16.intact());
        EXPECT_TRUE(dh16.intact());

        std::vector<float> a_wide(N * F), dh_wide(N * F);
        ops::cast_bf16_to_f32(cpu_exec(), a_wide.data(), a_cast.data(), N * F);
        ops::cast_bf16_to_f32(cpu_exec(), dh_wide.data(), dh_cast.data(), N * F);
        Guarded<float> aw(N * F), dhw(N * F);
        ops::activation_forward_bf16w(cpu_exec(), act, aw.data(), h.data(), pp, N, F);
        ops::activation_backward_bf16w(cpu_exec(), act, dhw.data(), dpw.data(), da.data(), h.data(),
                                       pp, N, F);
        EXPECT_EQ(0, std::memcmp(aw.data(), a_wide.data(), N * F * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(dhw.data(), dh_wide.data(), N * F * sizeof(float)));
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(dpw[n], dp[n]) << "dp (bf16w) " << n;
        EXPECT_TRUE(aw.intact());
        EXPECT_TRUE(dhw.intact());
      }
    }
  }
}

// loss = sum(a * R); da = R. Inputs keep away from squared ReLU's kink at 0 (its second
// derivative jumps there; a central difference across it is off by O(h)).
template <bool kFast>
void gradcheck(Activation act, int64_t N, int64_t F) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast " : "ref ") << ops::activation_name(act)
                                    << " N=" << N << " F=" << F);
  auto h = random_vec<double>(N * F, 5, -4, 4);
  for (double& x : h) {
    if (std::abs(x) < 0.01) x = 0.5;
  }
  auto p = random_vec<double>(N, 6, 0.1, 1);
  auto R = random_vec<double>(N * F, 7);
  std::vector<double> a(N * F), dh(N * F), dp(N);
  auto fwd = [&] {
    if (kFast)
      ops::cpu::activation_forward<double>(act, a.data(), h.data(), p.data(), N, F);
    else
      ops::activation_forward_ref<double>(act, a.data(), h.data(), p.data(), N, F);
  };
  auto loss = [&] {
    fwd();
    double l = 0;
    for (int64_t i = 0; i < N * F; ++i) l += a[i] * R[i];
    return l;
  };
  if (kFast)
    ops::cpu::activation_backward<double>(act, dh.data(), dp.data(), R.data(), h.data(), p.data(),
                                          N, F);
  else
    ops::activation_backward_ref<double>(act, dh.data(), dp.data(), R.data(), h.data(), p.data(), N,
                                         F);
  EXPECT_TRUE(check_gradient(loss, h.data(), dh.data(), N * F, "dh"));
  EXPECT_TRUE(check_gradient(loss, p.data(), dp.data(), N, "dp"));
}

TEST(Activation, GradientsMatchFiniteDifferences) {
  for (Activation act : kActs) {
    for (auto [N, F] : {Shape{1, 1}, Shape{1, 6}, Shape{13, 19}}) {
      gradcheck<true>(act, N, F);
      gradcheck<false>(act, N, F);
    }
  }
}

}  // namespace
}  // namespace moecore::testing
