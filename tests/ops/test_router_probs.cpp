// Routing probabilities: gather and probs fast == reference (K = 1, K = E, E not divisible by
// 8), softmax over K sums to the scaling factor, the normalised probs to ~it; dropped slots carry
// no gradient; and fp64 finite differences of topk_probs_backward for every ProbsFn (through the
// gather, the score function and the probs formula, with the routing held fixed).
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/testing.h"
#include "ops/router_probs.h"
#include "ops/router_scores.h"

namespace moecore::testing {
namespace {

using ops::ProbsFn;
using ops::ScoreFn;

const ProbsFn kProbsFns[] = {ProbsFn::SoftmaxOverK, ProbsFn::SoftmaxOverE, ProbsFn::Normalized,
                             ProbsFn::SigmoidTop1};

struct Case {
  int64_t T, E, K;
};
const Case kCases[] = {{1, 1, 1}, {13, 8, 2}, {9, 7, 7}, {20, 13, 1}, {6, 64, 8}, {0, 4, 2}};

// Distinct experts per token.
std::vector<int32_t> random_routing(int64_t T, int64_t E, int64_t K, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> idx(T * K), perm(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), gen);
    for (int64_t k = 0; k < K; ++k) idx[t * K + k] = perm[k];
  }
  return idx;
}

TEST(RouterProbs, GatherAndProbsMatchRef) {
  for (auto c : kCases) {
    for (ProbsFn fn : kProbsFns) {
      if (fn == ProbsFn::SigmoidTop1 && c.K != 1) continue;
      SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K
                                        << " fn=" << int(fn));
      auto src = random_vec<double>(c.T * c.E, 1, 0.01, 1);
      auto idx = random_routing(c.T, c.E, c.K, 2);
      Guarded<double> v(c.T * c.K), v_r(c.T * c.K), p(c.T * c.K), p_r(c.T * c.K);
      ops::gather_topk(cpu_exec(), v.data(), src.data(), idx.data(), c.T, c.E, c.K);
      ops::gather_topk_ref(v_r.data(), src.data(), idx.data(), c.T, c.E, c.K);
      EXPECT_EQ(v.vec(), v_r.vec());
      const double scale = 2.5;
      ops::topk_probs(cpu_exec(), fn, p.data(), v.data(), scale, c.T, c.K);
      ops::topk_probs_ref(fn, p_r.data(), v.data(), scale, c.T, c.K);
      EXPECT_TRUE(all_close(p.vec(), p_r.vec(), kF64Rtol, kF64Atol));
      for (auto* g : {&v, &v_r, &p, &p_r}) EXPECT_TRUE(g->intact());
      if (fn == ProbsFn::SoftmaxOverK || (fn == ProbsFn::Normalized && c.K > 1)) {
        for (int64_t t = 0; t < c.T; ++t) {
          double sum = 0;
          for (int64_t k = 0; k < c.K; ++k) sum += p[t * c.K + k];
          EXPECT_NEAR(sum, scale, 1e-14) << "row " << t;
        }
      }
    }
  }
}

TEST(RouterProbs, KeptGradsZeroAtDroppedSlots) {
  const std::vector<int32_t> idx = {0, -1, 2, -1, 1};
  const std::vector<float> dp = {1.f, 2.f, 3.f, 4.f, 5.f};
  Guarded<double> g(5), g_r(5);
  ops::kept_prob_grads<float>(cpu_exec(), g.data(), dp.data(), idx.data(), 0.5, 5);
  ops::kept_prob_grads_ref(g_r.data(), dp.data(), idx.data(), 0.5, 5);
  EXPECT_EQ(g.vec(), (std::vector<double>{0.5, 0, 1.5, 0, 2.5}));
  EXPECT_EQ(g_r.vec(), g.vec());
  EXPECT_TRUE(g.intact() && g_r.intact());
}

// The forward the backward differentiates: logits -> scores (as the router computes them for
// fn) -> values at the chosen experts -> probs (unscaled), loss = sum g * p.
struct Forward {
  ProbsFn fn;
  ScoreFn score;
  int64_t T, E, K;
  const std::vector<int32_t>* idx;
  std::vector<double> scores, v, p;
  void run(const std::vector<double>& l) {
    scores.assign(T * E, 0);
    v.assign(T * K, 0);
    p.assign(T * K, 0);
    const ScoreFn sf = fn == ProbsFn::SoftmaxOverE ? ScoreFn::Softmax : score;
    ops::router_scores_ref(sf, scores.data(), nullptr, l.data(), T, E);
    const bool on_logits = fn == ProbsFn::SoftmaxOverK || fn == ProbsFn::SigmoidTop1;
    ops::gather_topk_ref(v.data(), on_logits ? l.data() : scores.data(), idx->data(), T, E, K);
    if (fn == ProbsFn::SigmoidTop1) {
      ops::router_scores_ref(ScoreFn::Sigmoid, v.data(), nullptr, v.data(), T, K);
    }
    ops::topk_probs_ref(fn, p.data(), v.data(), 1.0, T, K);
  }
};

template <bool kFast>
void gradcheck(ProbsFn fn, ScoreFn score, Case c) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " fn=" << int(fn)
                                    << " score=" << int(score) << " T=" << c.T << " E=" << c.E
                                    << " K=" << c.K);
  auto l = random_vec<double>(c.T * c.E, 3, -2, 2);
  auto idx = random_routing(c.T, c.E, c.K, 4);
  auto g = random_vec<double>(c.T * c.K, 5);
  Forward f{fn, score, c.T, c.E, c.K, &idx, {}, {}, {}};
  auto loss = [&] {
    f.run(l);
    double s = 0;
    for (int64_t i = 0; i < c.T * c.K; ++i) s += g[i] * f.p[i];
    return s;
  };
  loss();
  std::vector<double> dl(c.T * c.E, 0.0), work(c.T * c.E);
  if (kFast) {
    ops::topk_probs_backward(cpu_exec(), fn, score, dl.data(), work.data(), g.data(), f.v.data(),
                             idx.data(), l.data(), f.scores.data(), c.T, c.E, c.K);
  } else {
    ops::topk_probs_backward_ref(fn, score, dl.data(), g.data(), f.v.data(), idx.data(), l.data(),
                                 f.scores.data(), c.T, c.E, c.K);
  }
  EXPECT_TRUE(check_gradient(loss, l.data(), dl.data(), {c.T, c.E}, "dlogits"));
}

TEST(RouterProbs, BackwardMatchesFiniteDifferences) {
  for (auto c : {Case{1, 1, 1}, Case{5, 8, 2}, Case{4, 6, 6}, Case{7, 9, 1}, Case{3, 33, 4}}) {
    gradcheck<true>(ProbsFn::SoftmaxOverK, ScoreFn::Softmax, c);
    gradcheck<false>(ProbsFn::SoftmaxOverK, ScoreFn::Softmax, c);
    gradcheck<true>(ProbsFn::SoftmaxOverE, ScoreFn::Softmax, c);
    gradcheck<false>(ProbsFn::SoftmaxOverE, ScoreFn::Softmax, c);
    for (ScoreFn s : {ScoreFn::Sigmoid, ScoreFn::SqrtSoftplus}) {
      gradcheck<true>(ProbsFn::Normalized, s, c);
      gradcheck<false>(ProbsFn::Normalized, s, c);
    }
    if (c.K == 1) {
      gradcheck<true>(ProbsFn::SigmoidTop1, ScoreFn::Softmax, c);
      gradcheck<false>(ProbsFn::SigmoidTop1, ScoreFn::Softmax, c);
    }
  }
}

TEST(RouterProbs, BackwardFastMatchesRef) {
  for (auto c : kCases) {
    for (ProbsFn fn : kProbsFns) {
      if (fn == ProbsFn::SigmoidTop1 && c.K != 1) continue;
      SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K
                                        << " fn=" << int(fn));
      const ScoreFn score = fn == ProbsFn::Normalized ? ScoreFn::SqrtSoftplus : ScoreFn::Softmax;
      auto l = random_vec<double>(c.T * c.E, 6, -3, 3);
      auto idx = random_routing(c.T, c.E, c.K, 7);
      auto g = random_vec<double>(c.T * c.K, 8);
      Forward f{fn, score, c.T, c.E, c.K, &idx, {}, {}, {}};
      f.run(l);
      auto dl0 = random_vec<double>(c.T * c.E, 9);
      Guarded<double> dl(c.T * c.E), dl_r(c.T * c.E), work(c.T * c.E);
      for (int64_t i = 0; i < c.T * c.E; ++i) dl[i] = dl_r[i] = dl0[i];
      ops::topk_probs_backward(cpu_exec(), fn, score, dl.data(), work.data(), g.data(),
                               f.v.data(), idx.data(), l.data(), f.scores.data(), c.T, c.E, c.K);
      ops::topk_probs_backward_ref(fn, score, dl_r.data(), g.data(), f.v.data(), idx.data(),
                                   l.data(), f.scores.data(), c.T, c.E, c.K);
      EXPECT_TRUE(all_close(dl.vec(), dl_r.vec(), kF64Rtol, kF64Atol));
      EXPECT_TRUE(dl.intact() && dl_r.intact() && work.intact());
    }
  }
}

}  // namespace
}  // namespace moecore::testing
