// LayerNorm: fast path vs f64-accumulating reference on awkward shapes, guard bytes on every
// output, the backward (dx, dw, db) vs fp64 finite differences with and without the zero-centred
// gain, and bitwise determinism across threads.
#include <omp.h>

#include <cstring>
#include <vector>

#include "common/testing.h"
#include "ops/cast.h"
#include "ops/layernorm.h"

namespace moecore::testing {
namespace {

using ops::layernorm_backward;
using ops::layernorm_backward_ref;
using ops::layernorm_forward;
using ops::layernorm_forward_ref;

struct Shape {
  int64_t T, H;
};
// T = 1, odd T, H not a multiple of 8, and shapes big enough to take the parallel branch.
const Shape kShapes[] = {{1, 1}, {1, 7}, {13, 37}, {3, 130}, {64, 256}, {70, 300}};
constexpr double kEps = 1e-5;

template <typename T>
void compare_fast_ref(double rtol, double atol) {
  for (bool zc : {false, true}) {
    for (auto [T_, H] : kShapes) {
      SCOPED_TRACE(::testing::Message() << "T=" << T_ << " H=" << H << " zero_centered=" << zc);
      // A mean far from 0 (x in [1, 5]): the statistics must not cancel.
      auto x = random_vec<T>(T_ * H, 1, 1, 5);
      auto w = zc ? random_vec<T>(H, 2, -0.5, 0.5) : random_vec<T>(H, 2, 0.5, 1.5);
      auto b = random_vec<T>(H, 5);
      auto dy = random_vec<T>(T_ * H, 3);
      auto dw0 = random_vec<T>(H, 4);  // dw, db accumulate: start from non-zero
      auto db0 = random_vec<T>(H, 6);
      Guarded<T> y(T_ * H), mean(T_), rstd(T_), dx(T_ * H), dw(H), db(H), y_r(T_ * H), mean_r(T_),
          rstd_r(T_), dx_r(T_ * H), dw_r(H), db_r(H);
      for (int64_t h = 0; h < H; ++h) dw[h] = dw_r[h] = dw0[h], db[h] = db_r[h] = db0[h];
      layernorm_forward<T>(cpu_exec(), y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                           b.data(), T_, H, kEps, zc);
      layernorm_forward_ref(y_r.data(), mean_r.data(), rstd_r.data(), x.data(), w.data(), b.data(),
                            T_, H, kEps, zc);
      layernorm_backward<T>(cpu_exec(), dx.data(), dw.data(), db.data(), dy.data(), x.data(),
                            w.data(), mean.data(), rstd.data(), T_, H, zc);
      layernorm_backward_ref(dx_r.data(), dw_r.data(), db_r.data(), dy.data(), x.data(), w.data(),
                             mean_r.data(), rstd_r.data(), T_, H, zc);
      EXPECT_TRUE(all_close(y.vec(), y_r.vec(), rtol, atol)) << "y";
      EXPECT_TRUE(all_close(mean.vec(), mean_r.vec(), rtol, atol)) << "mean";
      EXPECT_TRUE(all_close(rstd.vec(), rstd_r.vec(), rtol, atol)) << "rstd";
      EXPECT_TRUE(all_close(dx.vec(), dx_r.vec(), rtol, atol)) << "dx";
      EXPECT_TRUE(all_close(dw.vec(), dw_r.vec(), rtol, atol)) << "dw";
      EXPECT_TRUE(all_close(db.vec(), db_r.vec(), rtol, atol)) << "db";
      for (auto* g : {&y, &mean, &rstd, &dx, &dw, &db, &y_r, &mean_r, &rstd_r, &dx_r, &dw_r, &db_r})
        EXPECT_TRUE(g->intact());
    }
  }
}

TEST(LayerNorm, FastMatchesRefF32) {
  compare_fast_ref<float>(kF32Rtol, kF32Atol);
}
TEST(LayerNorm, FastMatchesRefF64) {
  compare_fast_ref<double>(kF64Rtol, kF64Atol);
}

// The bf16-valued output (--bf16, widened GEMM path) is the f32 output rounded, bitwise, with
// the same mean and rstd (serial and parallel shapes).
TEST(LayerNorm, Bf16wOutputIsTheRoundedF32Output) {
  for (bool zc : {false, true}) {
    for (auto [T_, H] : kShapes) {
      SCOPED_TRACE(::testing::Message() << "T=" << T_ << " H=" << H << " zero_centered=" << zc);
      auto x = random_vec<float>(T_ * H, 21, -2, 2);
      auto w = random_vec<float>(H, 22, 0.5, 1.5);
      auto b = random_vec<float>(H, 23);
      Guarded<float> y(T_ * H), mean(T_), rstd(T_), y16(T_ * H), mean16(T_), rstd16(T_);
      layernorm_forward<float>(cpu_exec(), y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                               b.data(), T_, H, kEps, zc);
      ops::layernorm_forward_bf16w(cpu_exec(), y16.data(), mean16.data(), rstd16.data(), x.data(),
                                   w.data(), b.data(), T_, H, kEps, zc);
      std::vector<float> rounded(T_ * H);
      ops::round_f32_to_bf16_ref(rounded.data(), y.data(), T_ * H);
      EXPECT_EQ(0, std::memcmp(y16.data(), rounded.data(), rounded.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(mean16.data(), mean.data(), T_ * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(rstd16.data(), rstd.data(), T_ * sizeof(float)));
      for (auto* g : {&y, &mean, &rstd, &y16, &mean16, &rstd16}) EXPECT_TRUE(g->intact());
    }
  }
}

// Unit gain (w = 1, or w = 0 zero-centred) and zero bias: every row has mean 0 and variance 1.
TEST(LayerNorm, UnitGainRowsHaveZeroMeanAndUnitVariance) {
  const int64_t T = 5, H = 33;
  auto x = random_vec<double>(T * H, 7, -3, 5);
  for (bool zc : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "zero_centered=" << zc);
    std::vector<double> w(H, zc ? 0.0 : 1.0), b(H, 0.0), y(T * H), mean(T), rstd(T);
    layernorm_forward<double>(cpu_exec(), y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                              b.data(), T, H, 0.0, zc);
    for (int64_t t = 0; t < T; ++t) {
      double s = 0, ss = 0;
      for (int64_t h = 0; h < H; ++h) s += y[t * H + h], ss += y[t * H + h] * y[t * H + h];
      EXPECT_NEAR(s / H, 0.0, 1e-14);
      EXPECT_NEAR(ss / H, 1.0, 1e-12);
    }
  }
}

// loss = sum(y * R); dy = R.
template <bool kFast>
void gradcheck(int64_t T, int64_t H, bool zc) {
  SCOPED_TRACE(::testing::Message()
               << (kFast ? "fast" : "ref") << " T=" << T << " H=" << H << " zero_centered=" << zc);
  auto x = random_vec<double>(T * H, 11, -2, 2);
  auto w = zc ? random_vec<double>(H, 12, -0.5, 0.5) : random_vec<double>(H, 12, 0.5, 1.5);
  auto b = random_vec<double>(H, 14);
  auto R = random_vec<double>(T * H, 13);
  std::vector<double> y(T * H), mean(T), rstd(T), dx(T * H), dw(H, 0.0), db(H, 0.0);
  auto fwd = kFast ? ops::cpu::layernorm_forward<double> : layernorm_forward_ref<double>;
  auto bwd = kFast ? ops::cpu::layernorm_backward<double> : layernorm_backward_ref<double>;
  auto loss = [&] {
    fwd(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), T, H, kEps, zc);
    double l = 0;
    for (int64_t i = 0; i < T * H; ++i) l += y[i] * R[i];
    return l;
  };
  loss();
  bwd(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), T, H,
      zc);
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), T * H, "dx"));
  EXPECT_TRUE(check_gradient(loss, w.data(), dw.data(), H, "dw"));
  EXPECT_TRUE(check_gradient(loss, b.data(), db.data(), H, "db"));
}

TEST(LayerNorm, GradientsMatchFiniteDifferences) {
  // H = 1: x - mean is 0, y = b, and dx, dw are exactly 0.
  for (bool zc : {false, true}) {
    for (auto [T, H] : {Shape{1, 1}, Shape{1, 5}, Shape{13, 9}, Shape{4, 37}}) {
      gradcheck<true>(T, H, zc);
      gradcheck<false>(T, H, zc);
    }
  }
}

TEST(LayerNorm, BitwiseDeterministicAcrossThreadCounts) {
  const int64_t T = 70, H = 300;
  auto x = random_vec<float>(T * H, 21, -2, 2);
  auto w = random_vec<float>(H, 22);
  auto b = random_vec<float>(H, 24);
  auto dy = random_vec<float>(T * H, 23);
  for (bool zc : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "zero_centered=" << zc);
    std::vector<float> y[2], mean[2], rstd[2], dx[2], dw[2], db[2];
    for (int i = 0; i < 2; ++i) {
      moecore::testing::ScopedOmpThreads threads(i == 0 ? 1 : 3);
      y[i].resize(T * H), mean[i].resize(T), rstd[i].resize(T), dx[i].resize(T * H);
      dw[i].assign(H, 0.f), db[i].assign(H, 0.f);
      layernorm_forward<float>(cpu_exec(), y[i].data(), mean[i].data(), rstd[i].data(), x.data(),
                               w.data(), b.data(), T, H, kEps, zc);
      layernorm_backward<float>(cpu_exec(), dx[i].data(), dw[i].data(), db[i].data(), dy.data(),
                                x.data(), w.data(), mean[i].data(), rstd[i].data(), T, H, zc);
    }
    EXPECT_EQ(y[0], y[1]);
    EXPECT_EQ(mean[0], mean[1]);
    EXPECT_EQ(rstd[0], rstd[1]);
    EXPECT_EQ(dx[0], dx[1]);
    EXPECT_EQ(dw[0], dw[1]);
    EXPECT_EQ(db[0], db[1]);
  }
}

}  // namespace
}  // namespace moecore::testing
