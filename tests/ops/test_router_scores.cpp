// Router score functions: fast == reference on awkward shapes (E = 1, E not divisible by 8,
// large |logits|), with guard bytes; aux scores of the elementwise functions sum to 1 (up to
// the epsilon); sigmoid in place; and fp64 finite differences of aux_scores_backward.
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "ops/router_scores.h"

namespace moecore::testing {
namespace {

using ops::ScoreFn;

const ScoreFn kFns[] = {ScoreFn::Softmax, ScoreFn::Sigmoid, ScoreFn::SqrtSoftplus};
struct Shape {
  int64_t T, E;
};
const Shape kShapes[] = {{1, 1}, {3, 2}, {13, 7}, {5, 64}, {70, 256}, {0, 8}};

TEST(RouterScores, FastMatchesRef) {
  for (ScoreFn fn : kFns) {
    for (auto [T, E] : kShapes) {
      SCOPED_TRACE(::testing::Message() << "fn=" << int(fn) << " T=" << T << " E=" << E);
      auto l = random_vec<double>(T * E, 1, -30, 30);
      Guarded<double> s(T * E), a(T * E), s_r(T * E), a_r(T * E);
      ops::router_scores(cpu_exec(), fn, s.data(), a.data(), l.data(), T, E);
      ops::router_scores_ref(fn, s_r.data(), a_r.data(), l.data(), T, E);
      if (fn == ScoreFn::Softmax) {
        EXPECT_TRUE(all_close(s.vec(), s_r.vec(), kF64Rtol, kF64Atol));
        EXPECT_TRUE(all_close(a.vec(), a_r.vec(), kF64Rtol, kF64Atol));
      } else {  // the same scalar functions in the same order: bitwise
        EXPECT_EQ(s.vec(), s_r.vec());
        EXPECT_EQ(a.vec(), a_r.vec());
      }
      for (auto* g : {&s, &a, &s_r, &a_r}) EXPECT_TRUE(g->intact());
      for (int64_t t = 0; t < T; ++t) {
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += a[t * E + e];
        EXPECT_NEAR(sum, 1.0, 4 * E * 2.2e-16) << "row " << t;
      }
      // Without aux scores, in place: the same scores.
      if (fn != ScoreFn::Softmax) {
        std::vector<double> y = l;
        ops::router_scores(cpu_exec(), fn, y.data(), nullptr, y.data(), T, E);
        EXPECT_EQ(y, s.vec());
      }
    }
  }
}

TEST(RouterScores, KnownValues) {
  const std::vector<double> l = {0.0, 2.0, -1000.0, 1000.0};
  std::vector<double> s(4), a(4);
  ops::router_scores(cpu_exec(), ScoreFn::Sigmoid, s.data(), a.data(), l.data(), 1, 4);
  EXPECT_EQ(s[0], 0.5);
  EXPECT_DOUBLE_EQ(s[1], 1.0 / (1.0 + std::exp(-2.0)));
  EXPECT_EQ(s[2], 0.0);
  EXPECT_EQ(s[3], 1.0);
  ops::router_scores(cpu_exec(), ScoreFn::SqrtSoftplus, s.data(), a.data(), l.data(), 1, 4);
  EXPECT_DOUBLE_EQ(s[0], std::sqrt(std::log(2.0)));
  EXPECT_EQ(s[2], 0.0);
  EXPECT_DOUBLE_EQ(s[3], std::sqrt(1000.0));  // no overflow
}

// loss = sum_te R_te * aux_scores(l)_te; its gradient through aux_scores_backward.
template <bool kFast>
void gradcheck(ScoreFn fn, int64_t T, int64_t E) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " fn=" << int(fn) << " T=" << T
                                    << " E=" << E);
  auto l = random_vec<double>(T * E, 3, -3, 3);
  auto R = random_vec<double>(T * E, 4);
  std::vector<double> s(T * E), a(T * E);
  auto loss = [&] {
    ops::router_scores_ref(fn, s.data(), a.data(), l.data(), T, E);
    double v = 0;
    for (int64_t i = 0; i < T * E; ++i) v += a[i] * R[i];
    return v;
  };
  loss();
  auto dl = random_vec<double>(T * E, 5);  // accumulates: start from something
  const std::vector<double> dl0 = dl;
  std::vector<double> daux = R;
  if (kFast) {
    ops::aux_scores_backward(cpu_exec(), fn, dl.data(), daux.data(), a.data(), s.data(), l.data(),
                             T, E);
  } else {
    ops::aux_scores_backward_ref(fn, dl.data(), daux.data(), a.data(), s.data(), l.data(), T, E);
  }
  for (int64_t i = 0; i < T * E; ++i) dl[i] -= dl0[i];
  EXPECT_TRUE(check_gradient(loss, l.data(), dl.data(), {T, E}, "dlogits"));
}

TEST(RouterScores, AuxBackwardMatchesFiniteDifferences) {
  for (ScoreFn fn : kFns) {
    for (auto [T, E] : {Shape{1, 1}, Shape{1, 3}, Shape{13, 8}, Shape{2, 33}}) {
      gradcheck<true>(fn, T, E);
      gradcheck<false>(fn, T, E);
    }
  }
}

TEST(RouterScores, AuxBackwardFastMatchesRef) {
  for (ScoreFn fn : kFns) {
    for (auto [T, E] : kShapes) {
      SCOPED_TRACE(::testing::Message() << "fn=" << int(fn) << " T=" << T << " E=" << E);
      auto l = random_vec<double>(T * E, 6, -4, 4);
      std::vector<double> s(T * E), a(T * E);
      ops::router_scores_ref(fn, s.data(), a.data(), l.data(), T, E);
      auto g = random_vec<double>(T * E, 7);
      std::vector<double> g2 = g;
      auto dl0 = random_vec<double>(T * E, 8);
      Guarded<double> dl(T * E), dl_r(T * E);
      for (int64_t i = 0; i < T * E; ++i) dl[i] = dl_r[i] = dl0[i];
      ops::aux_scores_backward(cpu_exec(), fn, dl.data(), g.data(), a.data(), s.data(), l.data(),
                               T, E);
      ops::aux_scores_backward_ref(fn, dl_r.data(), g2.data(), a.data(), s.data(), l.data(), T, E);
      EXPECT_TRUE(all_close(dl.vec(), dl_r.vec(), kF64Rtol, kF64Atol));
      EXPECT_TRUE(dl.intact() && dl_r.intact());
    }
  }
}

}  // namespace
}  // namespace moecore::testing
