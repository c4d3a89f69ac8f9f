// Router softmax and top-k: fast vs reference, in-place aliasing, rows summing to 1, -inf
// entries, tie-breaking to the lower index, K = 1 and K = E, and fp64 finite differences.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/softmax_topk.h"

namespace moecore::testing {
namespace {

using ops::softmax_backward;
using ops::softmax_backward_ref;
using ops::softmax_forward;
using ops::softmax_forward_ref;
using ops::topk;
using ops::topk_ref;

struct Shape {
  int64_t T, E;
};
const Shape kShapes[] = {{1, 1}, {1, 2}, {13, 7}, {5, 256}, {70, 256}};

template <typename T>
void compare_softmax(double rtol, double atol) {
  for (auto [T_, E] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << T_ << " E=" << E);
    auto x = random_vec<T>(T_ * E, 1, -8, 8);
    x[0] = -INFINITY;  // a masked expert: probability exactly 0 (E = 1 rows become NaN: skip)
    if (E == 1) x[0] = T(0.3);
    auto dy = random_vec<T>(T_ * E, 2);
    Guarded<T> y(T_ * E), y_r(T_ * E), dx(T_ * E), dx_r(T_ * E);
    softmax_forward<T>(cpu_exec(), y.data(), x.data(), T_, E);
    softmax_forward_ref(y_r.data(), x.data(), T_, E);
    softmax_backward<T>(cpu_exec(), dx.data(), dy.data(), y.data(), T_, E);
    softmax_backward_ref(dx_r.data(), dy.data(), y_r.data(), T_, E);
    EXPECT_TRUE(all_close(y.vec(), y_r.vec(), rtol, atol)) << "y";
    EXPECT_TRUE(all_close(dx.vec(), dx_r.vec(), rtol, atol)) << "dx";
    for (auto* g : {&y, &y_r, &dx, &dx_r}) EXPECT_TRUE(g->intact());
    if (E > 1) {
      EXPECT_EQ(y[0], T(0));
    }
    for (int64_t t = 0; t < T_; ++t) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += y[t * E + e];
      EXPECT_NEAR(s, 1.0, 4 * E * std::numeric_limits<T>::epsilon()) << "row " << t;
    }
    // In place (y aliases x, dx aliases dy) gives the same bits as out of place.
    std::vector<T> yi = x, dxi = dy;
    softmax_forward<T>(cpu_exec(), yi.data(), yi.data(), T_, E);
    softmax_backward<T>(cpu_exec(), dxi.data(), dxi.data(), yi.data(), T_, E);
    EXPECT_EQ(yi, y.vec());
    EXPECT_EQ(dxi, dx.vec());
  }
}

TEST(Softmax, FastMatchesRefF32) {
  compare_softmax<float>(kF32Rtol, kF32Atol);
}
TEST(Softmax, FastMatchesRefF64) {
  compare_softmax<double>(kF64Rtol, kF64Atol);
}

TEST(Softmax, LargeLogitsDoNotOverflow) {
  std::vector<float> x = {1000.f, 1000.f, -1000.f}, y(3);
  softmax_forward<float>(cpu_exec(), y.data(), x.data(), 1, 3);
  EXPECT_FLOAT_EQ(y[0], 0.5f);
  EXPECT_FLOAT_EQ(y[1], 0.5f);
  EXPECT_EQ(y[2], 0.f);
}

template <bool kFast>
void gradcheck(int64_t T, int64_t E) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " T=" << T << " E=" << E);
  auto x = random_vec<double>(T * E, 3, -3, 3);
  auto R = random_vec<double>(T * E, 4);
  std::vector<double> y(T * E), dx(T * E);
  auto fwd = kFast ? ops::cpu::softmax_forward<double> : softmax_forward_ref<double>;
  auto bwd = kFast ? ops::cpu::softmax_backward<double> : softmax_backward_ref<double>;
  auto loss = [&] {
    fwd(y.data(), x.data(), T, E);
    double l = 0;
    for (int64_t i = 0; i < T * E; ++i) l += y[i] * R[i];
    return l;
  };
  loss();
  bwd(dx.data(), R.data(), y.data(), T, E);
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), T * E, "dx"));
}

TEST(Softmax, GradientsMatchFiniteDifferences) {
  for (auto [T, E] : {Shape{1, 1}, Shape{1, 3}, Shape{13, 8}, Shape{2, 33}}) {
    gradcheck<true>(T, E);
    gradcheck<false>(T, E);
  }
}

template <typename T>
void compare_topk(int64_t T_, int64_t E, int64_t K, const std::vector<T>& x) {
  SCOPED_TRACE(::testing::Message() << "T=" << T_ << " E=" << E << " K=" << K);
  Guarded<int32_t> idx(T_ * K), idx_r(T_ * K);
  Guarded<T> val(T_ * K), val_r(T_ * K);
  topk<T>(cpu_exec(), idx.data(), val.data(), x.data(), T_, E, K);
  topk_ref(idx_r.data(), val_r.data(), x.data(), T_, E, K);
  EXPECT_EQ(idx.vec(), idx_r.vec());
  EXPECT_EQ(val.vec(), val_r.vec());
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(val[t * K + k], x[t * E + idx[t * K + k]]);
      if (k > 0) {  // descending, and ties in ascending index order
        T a = val[t * K + k - 1], b = val[t * K + k];
        EXPECT_TRUE(a > b || (a == b && idx[t * K + k - 1] < idx[t * K + k]));
      }
    }
  }
  for (auto* g : {&idx, &idx_r}) EXPECT_TRUE(g->intact());
  for (auto* g : {&val, &val_r}) EXPECT_TRUE(g->intact());
}

TEST(TopK, FastMatchesRefRandomAndTies) {
  for (auto [T, E] : kShapes) {
    auto cont = random_vec<float>(T * E, 5);
    // Small integers: many exact ties, plus some -inf (masked experts).
    std::mt19937 gen(6);
    std::vector<float> ties(T * E);
    for (auto& v : ties) {
      int r = int(gen() % 4);
      v = r == 3 ? -INFINITY : float(r);
    }
    auto contd = random_vec<double>(T * E, 7);
    for (int64_t K : {int64_t(1), std::min<int64_t>(2, E), std::min<int64_t>(8, E), E}) {
      compare_topk<float>(T, E, K, cont);
      compare_topk<float>(T, E, K, ties);
      compare_topk<double>(T, E, K, contd);
    }
  }
}

TEST(TopK, HandExamples) {
  const float ninf = -INFINITY;
  std::vector<float> x = {1,    3,    3,    2,    3,    // ties: the lower index first
                          ninf, ninf, 0.5f, ninf, -7};  // -inf last, ties among -inf by index
  std::vector<int32_t> idx(2 * 5);
  std::vector<float> val(2 * 5);
  topk<float>(cpu_exec(), idx.data(), val.data(), x.data(), 2, 5, 5);
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 4, 3, 0, 2, 4, 0, 1, 3}));
  topk<float>(cpu_exec(), idx.data(), val.data(), x.data(), 2, 5, 3);
  EXPECT_EQ(std::vector<int32_t>(idx.begin(), idx.begin() + 6),
            (std::vector<int32_t>{1, 2, 4, 2, 4, 0}));
  EXPECT_EQ(val[3], 0.5f);
  EXPECT_EQ(val[4], -7.f);
  EXPECT_EQ(val[5], ninf);
}

TEST(TopK, RejectsBadK) {
  std::vector<float> x(4);
  std::vector<int32_t> idx(8);
  std::vector<float> val(8);
  EXPECT_THROW(topk<float>(cpu_exec(), idx.data(), val.data(), x.data(), 1, 4, 5), moecore::Error);
  EXPECT_THROW(topk<float>(cpu_exec(), idx.data(), val.data(), x.data(), 1, 4, 0), moecore::Error);
  EXPECT_THROW(topk_ref(idx.data(), val.data(), x.data(), 1, 4, 5), moecore::Error);
}

}  // namespace
}  // namespace moecore::testing
