// SwiGLU with routing probability: fast vs reference (with and without p), guard bytes, fp64
// finite differences for dh and dp, and p = null equal to p = 1.
#include <vector>

#include "common/testing.h"
#include "ops/cast.h"
#include "ops/swiglu.h"

namespace moecore::testing {
namespace {

using ops::swiglu_backward;
using ops::swiglu_backward_ref;
using ops::swiglu_forward;
using ops::swiglu_forward_ref;

struct Shape {
  int64_t N, F;
};
// N = 0 (an expert with no tokens), N = 1, odd N, F not a multiple of 8, one parallel shape.
const Shape kShapes[] = {{0, 5}, {1, 1}, {1, 7}, {13, 37}, {64, 300}};

template <typename T>
void compare_fast_ref(bool with_p, double rtol, double atol) {
  for (auto [N, F] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " F=" << F << " p=" << with_p);
    auto h = random_vec<T>(N * 2 * F, 1, -6, 6);  // wide range: both tails of the sigmoid
    auto p = random_vec<T>(N, 2, 0, 1);
    auto da = random_vec<T>(N * F, 3);
    const T* pp = with_p ? p.data() : nullptr;
    Guarded<T> a(N * F), dh(N * 2 * F), dp(N), a_r(N * F), dh_r(N * 2 * F), dp_r(N);
    swiglu_forward<T>(cpu_exec(), a.data(), h.data(), pp, N, F);
    swiglu_forward_ref(a_r.data(), h.data(), pp, N, F);
    swiglu_backward<T>(cpu_exec(), dh.data(), dp.data(), da.data(), h.data(), pp, N, F);
    swiglu_backward_ref(dh_r.data(), dp_r.data(), da.data(), h.data(), pp, N, F);
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

TEST(SwiGlu, FastMatchesRefF32) {
  compare_fast_ref<float>(true, kF32Rtol, kF32Atol);
  compare_fast_ref<float>(false, kF32Rtol, kF32Atol);
}
TEST(SwiGlu, FastMatchesRefF64) {
  compare_fast_ref<double>(true, kF64Rtol, kF64Atol);
  compare_fast_ref<double>(false, kF64Rtol, kF64Atol);
}

TEST(SwiGlu, NullProbEqualsUnitProb) {
  const int64_t N = 5, F = 11;
  auto h = random_vec<float>(N * 2 * F, 4, -3, 3);
  std::vector<float> ones(N, 1.f), a0(N * F), a1(N * F);
  swiglu_forward<float>(cpu_exec(), a0.data(), h.data(), nullptr, N,
                        F);  // nullptr: T not deducible
  swiglu_forward<float>(cpu_exec(), a1.data(), h.data(), ones.data(), N, F);
  EXPECT_EQ(a0, a1);
}

// --bf16 outputs: bitwise the bf16 cast of the f32 fast path's outputs; dp (f32) bitwise the
// f32 path's dp (one association of the sum whatever vector width each loop gets).
TEST(SwiGlu, Bf16OutputsAreTheCastOfF32) {
  for (auto [N, F] : kShapes) {
    for (bool with_p : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "N=" << N << " F=" << F << " p=" << with_p);
      auto h = random_vec<float>(N * 2 * F, 8, -6, 6);
      auto p = random_vec<float>(N, 9, 0, 1);
      auto da = random_vec<float>(N * F, 10);
      const float* pp = with_p ? p.data() : nullptr;
      std::vector<float> a(N * F), dh(N * 2 * F), dp(N, -1.f), dp16(N, -1.f);
      swiglu_forward<float>(cpu_exec(), a.data(), h.data(), pp, N, F);
      swiglu_backward<float>(cpu_exec(), dh.data(), dp.data(), da.data(), h.data(), pp, N, F);
      std::vector<bf16> a_cast(N * F), dh_cast(N * 2 * F);
      ops::cast_f32_to_bf16(cpu_exec(), a_cast.data(), a.data(), N * F);
      ops::cast_f32_to_bf16(cpu_exec(), dh_cast.data(), dh.data(), N * 2 * F);
      Guarded<uint16_t> a16(N * F), dh16(N * 2 * F);  // bf16 bits
      ops::swiglu_forward_bf16(cpu_exec(), reinterpret_cast<bf16*>(a16.data()), h.data(), pp, N, F);
      ops::swiglu_backward_bf16(cpu_exec(), reinterpret_cast<bf16*>(dh16.data()), dp16.data(),
                                da.data(), h.data(), pp, N, F);
      for (int64_t i = 0; i < N * F; ++i) ASSERT_EQ(a16[i], a_cast[i].bits) << "a " << i;
      for (int64_t i = 0; i < N * 2 * F; ++i) ASSERT_EQ(dh16[i], dh_cast[i].bits) << "dh " << i;
      if (with_p) {
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(dp16[n], dp[n]) << "dp " << n;
      } else {
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(dp16[n], -1.f) << "dp written without p";
      }
      EXPECT_TRUE(a16.intact());
      EXPECT_TRUE(dh16.intact());
    }
  }
}

// The widened outputs (widened-bf16 GEMM path) are the bf16 outputs widened, bitwise. (dp is
// the same f32 sum in both kernels; its tolerance is Bf16OutputsAreTheCastOfF32's business.)
TEST(SwiGlu, WidenedOutputsAreTheBf16OutputsWidened) {
  for (auto [N, F] : kShapes) {
    for (bool with_p : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "N=" << N << " F=" << F << " p=" << with_p);
      auto h = random_vec<float>(N * 2 * F, 8, -6, 6);
      auto p = random_vec<float>(N, 9, 0, 1);
      auto da = random_vec<float>(N * F, 10);
      const float* pp = with_p ? p.data() : nullptr;
      std::vector<bf16> a16(N * F), dh16(N * 2 * F);
      std::vector<float> dp16(N, -1.f), dpw(N, -1.f), a_ref(N * F), dh_ref(N * 2 * F);
      ops::swiglu_forward_bf16(cpu_exec(), a16.data(), h.data(), pp, N, F);
      ops::swiglu_backward_bf16(cpu_exec(), dh16.data(), dp16.data(), da.data(), h.data(), pp, N,
                                F);
      ops::cast_bf16_to_f32(cpu_exec(), a_ref.data(), a16.data(), N * F);
      ops::cast_bf16_to_f32(cpu_exec(), dh_ref.data(), dh16.data(), N * 2 * F);
      Guarded<float> aw(N * F), dhw(N * 2 * F);
      ops::swiglu_forward_bf16w(cpu_exec(), aw.data(), h.data(), pp, N, F);
      ops::swiglu_backward_bf16w(cpu_exec(), dhw.data(), dpw.data(), da.data(), h.data(), pp, N, F);
      EXPECT_EQ(0, std::memcmp(aw.data(), a_ref.data(), N * F * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(dhw.data(), dh_ref.data(), N * 2 * F * sizeof(float)));
      for (int64_t n = 0; n < N; ++n) ASSERT_EQ(dpw[n], dp16[n]) << "dp " << n;  // -1: unwritten
      EXPECT_TRUE(aw.intact());
      EXPECT_TRUE(dhw.intact());
    }
  }
}

// loss = sum(a * R); da = R.
template <bool kFast>
void gradcheck(int64_t N, int64_t F) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " N=" << N << " F=" << F);
  auto h = random_vec<double>(N * 2 * F, 5, -4, 4);
  auto p = random_vec<double>(N, 6, 0.1, 1);
  auto R = random_vec<double>(N * F, 7);
  std::vector<double> a(N * F), dh(N * 2 * F), dp(N);
  auto fwd = kFast ? ops::cpu::swiglu_forward<double> : swiglu_forward_ref<double>;
  auto bwd = kFast ? ops::cpu::swiglu_backward<double> : swiglu_backward_ref<double>;
  auto loss = [&] {
    fwd(a.data(), h.data(), p.data(), N, F);
    double l = 0;
    for (int64_t i = 0; i < N * F; ++i) l += a[i] * R[i];
    return l;
  };
  bwd(dh.data(), dp.data(), R.data(), h.data(), p.data(), N, F);
  EXPECT_TRUE(check_gradient(loss, h.data(), dh.data(), N * 2 * F, "dh"));
  EXPECT_TRUE(check_gradient(loss, p.data(), dp.data(), N, "dp"));
}

TEST(SwiGlu, GradientsMatchFiniteDifferences) {
  for (auto [N, F] : {Shape{1, 1}, Shape{1, 6}, Shape{13, 9}}) {
    gradcheck<true>(N, F);
    gradcheck<false>(N, F);
  }
}

}  // namespace
}  // namespace moecore::testing
