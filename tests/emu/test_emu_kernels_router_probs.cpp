// The routing probability kernels (src/ops/cuda/router_probs.cu) in the grid emulator against
// their references: the gather and kept_prob_grads bitwise, the probs and their backward within
// the f64 tolerance (docs/numerics.md: the device's exp, another summation order), all with
// NaN-poisoned guarded outputs (the backward accumulating onto random dlogits, its scratch
// NaN-filled) and bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/router_probs.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using ops::ProbsFn;
using ops::ScoreFn;
using testing::Guarded;
using testing::random_vec;

struct TEK {
  int64_t T, E, K;
};
// One token and expert; K = 1 and K = E; E not a multiple of 8 or 32; more tokens than a block's
// threads (several blocks of the grid-stride kernels); more experts than a block's threads
// (SoftmaxOverE's strided rows); no tokens.
const TEK kShapes[] = {{1, 1, 1},  {3, 5, 2},   {33, 7, 7},  {40, 13, 1},
                       {5, 64, 8}, {270, 9, 3}, {3, 300, 4}, {0, 4, 2}};

// K distinct experts per token, in random order; `drop` of the slots -1 (dropped by capacity).
std::vector<int32_t> distinct_experts(int64_t T, int64_t K, int64_t E, double drop, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int32_t> idx(static_cast<size_t>(T * K)), perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), gen);
    for (int64_t k = 0; k < K; ++k) idx[size_t(t * K + k)] = u(gen) < drop ? -1 : perm[size_t(k)];
  }
  return idx;
}

// The score functions of the router's forward (router_scores_ref's, written out here: the
// sanitizer build links each kernel's own reference only), per row of logits [T, E].
void score_rows(ScoreFn f, double* s_TE, const double* l_TE, int64_t T, int64_t E) {
  for (int64_t t = 0; t < T; ++t) {
    const double* l = l_TE + t * E;
    double* s = s_TE + t * E;
    if (f == ScoreFn::Softmax) {
      double m = -INFINITY, z = 0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
      for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
      for (int64_t e = 0; e < E; ++e) s[e] = std::exp(l[e] - m) / z;
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const double x = l[e];
        s[e] = f == ScoreFn::Sigmoid
                   ? 1.0 / (1.0 + std::exp(-x))
                   : std::sqrt(x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)));
      }
    }
  }
}

const char* probs_name(ProbsFn fn) {
  switch (fn) {
    case ProbsFn::SoftmaxOverK:
      return "softmax_over_k";
    case ProbsFn::SoftmaxOverE:
      return "softmax_over_e";
    case ProbsFn::Normalized:
      return "normalized";
    default:
      return "sigmoid_top1";
  }
}
const ProbsFn kFns[] = {ProbsFn::SoftmaxOverK, ProbsFn::SoftmaxOverE, ProbsFn::Normalized,
                        ProbsFn::SigmoidTop1};

void expect_close(const Guarded<double>& got, const std::vector<double>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  for (int64_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[size_t(i)], kAtol<double> + kRtol<double> * std::abs(want[size_t(i)]))
        << what << " element " << i;
  }
}

TEST(EmuKernelsRouterProbs, GatherIsTheReferenceBitwiseInEveryOrder) {
  uint32_t seed = 500;
  for (const TEK c : kShapes) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) +
                 " K=" + std::to_string(c.K));
    const auto src = random_vec<double>(c.T * c.E, seed++, -2, 2);
    const auto idx = distinct_experts(c.T, c.K, c.E, 0.0, seed++);
    std::vector<double> want(static_cast<size_t>(c.T * c.K));
    ops::gather_topk_ref(want.data(), src.data(), idx.data(), c.T, c.E, c.K);
    Guarded<double> v(c.T * c.K, NAN);
    EXPECT_EQ(order_dependence([&] {
                Guarded<double> v1(c.T * c.K, NAN);
                ops::cuda::gather_topk(nullptr, v1.data(), src.data(), idx.data(), c.T, c.E, c.K);
                v = v1;
                return bytes_of(v1.data(), size_t(c.T * c.K));
              }),
              "");
    EXPECT_TRUE(v.intact());
    EXPECT_EQ(bytes_of(v.data(), size_t(c.T * c.K)), bytes_of(want.data(), want.size()));
  }
}

TEST(EmuKernelsRouterProbs, ProbsMatchTheReferenceInEveryOrder) {
  uint32_t seed = 520;
  for (const TEK c : kShapes) {
    const auto v = random_vec<double>(c.T * c.K, seed++, 0.01, 1);
    for (ProbsFn fn : kFns) {
      if (fn == ProbsFn::SigmoidTop1 && c.K != 1) continue;
      for (double scale : {1.0, 2.5}) {
        SCOPED_TRACE(std::string(probs_name(fn)) + " T=" + std::to_string(c.T) +
                     " K=" + std::to_string(c.K) + " scale=" + std::to_string(scale));
        std::vector<double> want(static_cast<size_t>(c.T * c.K));
        ops::topk_probs_ref(fn, want.data(), v.data(), scale, c.T, c.K);
        Guarded<double> p(c.T * c.K, NAN);
        EXPECT_EQ(order_dependence([&] {
                    Guarded<double> p1(c.T * c.K, NAN);
                    ops::cuda::topk_probs(nullptr, fn, p1.data(), v.data(), scale, c.T, c.K);
                    p = p1;
                    return bytes_of(p1.data(), size_t(c.T * c.K));
                  }),
                  "");
        expect_close(p, want, "probs_TK");
      }
    }
  }
}

template <typename T>
void check_kept_prob_grads(int64_t TK, double drop, uint32_t seed) {
  SCOPED_TRACE("TK=" + std::to_string(TK) + " drop=" + std::to_string(drop));
  const auto idx = distinct_experts(TK, 1, 8, drop, seed);
  const auto dp = random_vec<T>(TK, seed + 1);
  std::vector<double> want(static_cast<size_t>(TK));
  ops::kept_prob_grads_ref(want.data(), dp.data(), idx.data(), 0.5, TK);
  Guarded<double> g(TK, NAN);
  EXPECT_EQ(order_dependence([&] {
              Guarded<double> g1(TK, NAN);
              ops::cuda::kept_prob_grads<T>(nullptr, g1.data(), dp.data(), idx.data(), 0.5, TK);
              g = g1;
              return bytes_of(g1.data(), size_t(TK));
            }),
            "");
  EXPECT_TRUE(g.intact());
  EXPECT_EQ(bytes_of(g.data(), size_t(TK)), bytes_of(want.data(), want.size()));
}

// Dropped slots give exactly 0; f32 and f64 dprobs; more slots than a block's threads.
TEST(EmuKernelsRouterProbs, KeptProbGradsAreTheReferenceBitwiseInEveryOrder) {
  uint32_t seed = 540;
  for (int64_t TK : {0, 1, 7, 33, 257, 1000}) {
    for (double drop : {0.0, 0.3}) {
      check_kept_prob_grads<float>(TK, drop, seed += 2);
      check_kept_prob_grads<double>(TK, drop, seed += 2);
    }
  }
}

// The reference forward (scores, values, as the router computes them for fn), then the backward
// accumulating onto random dlogits, the scratch NaN-filled.
TEST(EmuKernelsRouterProbs, BackwardMatchesTheReferenceInEveryOrder) {
  uint32_t seed = 560;
  for (const TEK c : kShapes) {
    for (ProbsFn fn : kFns) {
      if (fn == ProbsFn::SigmoidTop1 && c.K != 1) continue;
      std::vector<ScoreFn> scores = {ScoreFn::Softmax};
      if (fn == ProbsFn::Normalized) scores = {ScoreFn::Sigmoid, ScoreFn::SqrtSoftplus};
      for (ScoreFn score : scores) {
        SCOPED_TRACE(std::string(probs_name(fn)) + " score " + std::to_string(int(score)) +
                     " T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) +
                     " K=" + std::to_string(c.K));
        const int64_t TE = c.T * c.E;
        const auto l = random_vec<double>(TE, seed++, -3, 3);
        const auto idx = distinct_experts(c.T, c.K, c.E, 0.0, seed++);
        const auto g = random_vec<double>(c.T * c.K, seed++);
        std::vector<double> s(static_cast<size_t>(TE)), v(static_cast<size_t>(c.T * c.K));
        const ScoreFn sf = fn == ProbsFn::SoftmaxOverE ? ScoreFn::Softmax : score;
        score_rows(sf, s.data(), l.data(), c.T, c.E);
        const bool on_logits = fn == ProbsFn::SoftmaxOverK || fn == ProbsFn::SigmoidTop1;
        ops::gather_topk_ref(v.data(), on_logits ? l.data() : s.data(), idx.data(), c.T, c.E, c.K);
        if (fn == ProbsFn::SigmoidTop1) {
          score_rows(ScoreFn::Sigmoid, v.data(), v.data(), c.T, c.K);
        }
        const auto dl0 = random_vec<double>(TE, seed++);
        std::vector<double> want = dl0;
        ops::topk_probs_backward_ref(fn, score, want.data(), g.data(), v.data(), idx.data(),
                                     l.data(), s.data(), c.T, c.E, c.K);
        Guarded<double> dl(TE);
        bool work_intact = true;
        EXPECT_EQ(order_dependence([&] {
                    Guarded<double> dl1(TE), work(TE, NAN);
                    for (int64_t i = 0; i < TE; ++i) dl1[i] = dl0[size_t(i)];
                    ops::cuda::topk_probs_backward(nullptr, fn, score, dl1.data(), work.data(),
                                                   g.data(), v.data(), idx.data(), l.data(),
                                                   s.data(), c.T, c.E, c.K);
                    work_intact = work_intact && work.intact();
                    dl = dl1;
                    return bytes_of(dl1.data(), size_t(TE));
                  }),
                  "");
        EXPECT_TRUE(work_intact) << "work_TE written outside its elements";
        expect_close(dl, want, "dlogits_TE");
      }
    }
  }
}

TEST(EmuKernelsRouterProbs, BadArgumentsAreErrors) {
  double d = 0;
  int32_t i = 0;
  EXPECT_THROW(ops::cuda::gather_topk(nullptr, &d, &d, &i, 1, 2, 3), Error);  // K > E
  EXPECT_THROW(ops::cuda::gather_topk(nullptr, &d, &d, &i, -1, 2, 1), Error);
  EXPECT_THROW(ops::cuda::topk_probs(nullptr, ProbsFn::SoftmaxOverK, &d, &d, 1.0, 1, 0), Error);
  EXPECT_THROW(ops::cuda::kept_prob_grads<double>(nullptr, &d, &d, &i, 1.0, -1), Error);
  EXPECT_THROW(ops::cuda::topk_probs_backward(nullptr, ProbsFn::SigmoidTop1, ScoreFn::Softmax, &d,
                                              &d, &d, &d, &i, &d, &d, 1, 4, 2),
               Error);
  EXPECT_THROW(ops::cuda::topk_probs_backward(nullptr, ProbsFn::Normalized, ScoreFn::Softmax, &d,
                                              &d, &d, &d, &i, &d, &d, 1, 4, 2),
               Error);
  EXPECT_THROW(ops::cuda::topk_probs_backward(nullptr, ProbsFn::SoftmaxOverK, ScoreFn::Softmax, &d,
                                              &d, &d, &d, &i, &d, &d, 1, 0, 1),
               Error);
}

}  // namespace
}  // namespace moecore
