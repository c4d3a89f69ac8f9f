// RMSNorm: fast path vs f64-accumulating reference on awkward shapes, guard bytes on every
// output, both backwards vs fp64 finite differences, and bitwise determinism across threads.
#include <omp.h>

#include <cstring>
#include <vector>

#include "common/testing.h"
#include "ops/cast.h"
#include "ops/rmsnorm.h"

namespace moecore::testing {
namespace {

using ops::rmsnorm_backward;
using ops::rmsnorm_backward_ref;
using ops::rmsnorm_forward;
using ops::rmsnorm_forward_ref;

struct Shape {
  int64_t T, H;
};
// T = 1, odd T, H not a multiple of 8, and one shape big enough to take the parallel branch.
const Shape kShapes[] = {{1, 1}, {1, 7}, {13, 37}, {3, 130}, {64, 256}, {70, 300}};
constexpr double kEps = 1e-6;

template <typename T>
void compare_fast_ref(double rtol, double atol) {
  for (auto [T_, H] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << T_ << " H=" << H);
    auto x = random_vec<T>(T_ * H, 1, -2, 2);
    auto w = random_vec<T>(H, 2, 0.5, 1.5);
    auto dy = random_vec<T>(T_ * H, 3);
    auto dw0 = random_vec<T>(H, 4);  // dw accumulates: start from non-zero
    Guarded<T> y(T_ * H), rstd(T_), dx(T_ * H), dw(H), y_r(T_ * H), rstd_r(T_), dx_r(T_ * H),
        dw_r(H);
    for (int64_t h = 0; h < H; ++h) dw[h] = dw_r[h] = dw0[h];
    rmsnorm_forward<T>(cpu_exec(), y.data(), rstd.data(), x.data(), w.data(), T_, H, kEps);
    rmsnorm_forward_ref(y_r.data(), rstd_r.data(), x.data(), w.data(), T_, H, kEps);
    rmsnorm_backward<T>(cpu_exec(), dx.data(), dw.data(), dy.data(), x.data(), w.data(),
                        rstd.data(), T_, H);
    rmsnorm_backward_ref(dx_r.data(), dw_r.data(), dy.data(), x.data(), w.data(), rstd_r.data(), T_,
                         H);
    EXPECT_TRUE(all_close(y.vec(), y_r.vec(), rtol, atol)) << "y";
    EXPECT_TRUE(all_close(rstd.vec(), rstd_r.vec(), rtol, atol)) << "rstd";
    EXPECT_TRUE(all_close(dx.vec(), dx_r.vec(), rtol, atol)) << "dx";
    EXPECT_TRUE(all_close(dw.vec(), dw_r.vec(), rtol, atol)) << "dw";
    for (auto* g : {&y, &rstd, &dx, &dw, &y_r, &rstd_r, &dx_r, &dw_r}) EXPECT_TRUE(g->intact());
  }
}

TEST(RmsNorm, FastMatchesRefF32) {
  compare_fast_ref<float>(kF32Rtol, kF32Atol);
}
TEST(RmsNorm, FastMatchesRefF64) {
  compare_fast_ref<double>(kF64Rtol, kF64Atol);
}

// The bf16-valued output (--bf16, widened GEMM path) is the f32 output rounded, bitwise, with
// the same rstd (serial and parallel shapes).
TEST(RmsNorm, Bf16wOutputIsTheRoundedF32Output) {
  for (auto [T_, H] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << T_ << " H=" << H);
    auto x = random_vec<float>(T_ * H, 21, -2, 2);
    auto w = random_vec<float>(H, 22, 0.5, 1.5);
    Guarded<float> y(T_ * H), rstd(T_), y16(T_ * H), rstd16(T_);
    rmsnorm_forward<float>(cpu_exec(), y.data(), rstd.data(), x.data(), w.data(), T_, H, kEps);
    ops::rmsnorm_forward_bf16w(cpu_exec(), y16.data(), rstd16.data(), x.data(), w.data(), T_, H,
                               kEps);
    std::vector<float> rounded(T_ * H);
    ops::round_f32_to_bf16_ref(rounded.data(), y.data(), T_ * H);
    EXPECT_EQ(0, std::memcmp(y16.data(), rounded.data(), rounded.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(rstd16.data(), rstd.data(), T_ * sizeof(float)));
    for (auto* g : {&y, &rstd, &y16, &rstd16}) EXPECT_TRUE(g->intact());
  }
}

TEST(RmsNorm, UnitWeightRowsHaveUnitRms) {
  const int64_t T = 5, H = 33;
  auto x = random_vec<double>(T * H, 7, -3, 3);
  std::vector<double> w(H, 1.0), y(T * H), rstd(T);
  rmsnorm_forward<double>(cpu_exec(), y.data(), rstd.data(), x.data(), w.data(), T, H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t h = 0; h < H; ++h) ss += y[t * H + h] * y[t * H + h];
    EXPECT_NEAR(ss / H, 1.0, 1e-12);
  }
}

// loss = sum(y * R); dy = R.
template <bool kFast>
void gradcheck(int64_t T, int64_t H) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " T=" << T << " H=" << H);
  auto x = random_vec<double>(T * H, 11, -2, 2);
  auto w = random_vec<double>(H, 12, 0.5, 1.5);
  auto R = random_vec<double>(T * H, 13);
  std::vector<double> y(T * H), rstd(T), dx(T * H), dw(H, 0.0);
  auto fwd = kFast ? ops::cpu::rmsnorm_forward<double> : rmsnorm_forward_ref<double>;
  auto bwd = kFast ? ops::cpu::rmsnorm_backward<double> : rmsnorm_backward_ref<double>;
  auto loss = [&] {
    fwd(y.data(), rstd.data(), x.data(), w.data(), T, H, kEps);
    double l = 0;
    for (int64_t i = 0; i < T * H; ++i) l += y[i] * R[i];
    return l;
  };
  loss();
  bwd(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), T, H);
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), T * H, "dx"));
  EXPECT_TRUE(check_gradient(loss, w.data(), dw.data(), H, "dw"));
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  for (auto [T, H] : {Shape{1, 1}, Shape{1, 5}, Shape{13, 9}, Shape{4, 37}}) {
    gradcheck<true>(T, H);
    gradcheck<false>(T, H);
  }
}

TEST(RmsNorm, BitwiseDeterministicAcrossThreadCounts) {
  const int64_t T = 70, H = 300;
  auto x = random_vec<float>(T * H, 21, -2, 2);
  auto w = random_vec<float>(H, 22);
  auto dy = random_vec<float>(T * H, 23);
  std::vector<float> y[2], rstd[2], dx[2], dw[2];
  for (int i = 0; i < 2; ++i) {
    moecore::testing::ScopedOmpThreads threads(i == 0 ? 1 : 3);
    y[i].resize(T * H), rstd[i].resize(T), dx[i].resize(T * H), dw[i].assign(H, 0.f);
    rmsnorm_forward<float>(cpu_exec(), y[i].data(), rstd[i].data(), x.data(), w.data(), T, H, kEps);
    rmsnorm_backward<float>(cpu_exec(), dx[i].data(), dw[i].data(), dy.data(), x.data(), w.data(),
                            rstd[i].data(), T, H);
  }
  EXPECT_EQ(y[0], y[1]);
  EXPECT_EQ(rstd[0], rstd[1]);
  EXPECT_EQ(dx[0], dx[1]);
  EXPECT_EQ(dw[0], dw[1]);
}

}  // namespace
}  // namespace moecore::testing
