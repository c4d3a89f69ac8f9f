// The router score kernels (src/ops/cuda/router_scores.cu) in the grid emulator against their
// `_ref`: softmax scores and every backward within the f64 tolerance (docs/numerics.md), the
// sigmoid / sqrt(softplus) scores and aux scores bitwise (the same scalar functions summed in the
// same order), in place without aux scores too, with NaN-poisoned guarded outputs, dlogits
// accumulated onto random values, and bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <iterator>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/router_scores.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using ops::ScoreFn;
using testing::Guarded;
using testing::random_vec;

const ScoreFn kFns[] = {ScoreFn::Softmax, ScoreFn::Sigmoid, ScoreFn::SqrtSoftplus};
struct TE {
  int64_t T, E;
};
// One expert; E not a multiple of 32; E over the block. Sigmoid and sqrt(softplus) also on more
// rows than their thread-per-row block.
const TE kShapes[] = {{1, 1}, {3, 2}, {13, 7}, {2, 64}, {2, 257}};
const TE kManyRows = {130, 3};

void expect_close(const Guarded<double>& got, const std::vector<double>& want, const char* what) {
  for (int64_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[size_t(i)], kAtol<double> + kRtol<double> * std::abs(want[size_t(i)]))
        << what << " element " << i;
  }
}
void expect_bitwise(const Guarded<double>& got, const std::vector<double>& want, const char* what) {
  EXPECT_EQ(bytes_of(got.data(), size_t(got.size())), bytes_of(want.data(), want.size())) << what;
}

TEST(EmuKernelsRouterScores, ScoresMatchTheReferenceInEveryOrder) {
  uint32_t seed = 300;
  for (ScoreFn fn : kFns) {
    std::vector<TE> shapes(std::begin(kShapes), std::end(kShapes));
    if (fn != ScoreFn::Softmax) shapes.push_back(kManyRows);
    for (auto [T, E] : shapes) {
      SCOPED_TRACE("fn=" + std::to_string(int(fn)) + " tokens=" + std::to_string(T) +
                   " E=" + std::to_string(E));
      const std::vector<double> l = random_vec<double>(T * E, seed++, -30, 30);
      std::vector<double> s_ref(size_t(T * E)), a_ref(size_t(T * E));
      ops::router_scores_ref(fn, s_ref.data(), a_ref.data(), l.data(), T, E);
      Guarded<double> s(T * E), a(T * E), y(T * E);
      const std::string diff = order_dependence([&] {
        Guarded<double> s1(T * E, NAN), a1(T * E, NAN), y1(T * E);
        for (int64_t i = 0; i < T * E; ++i) y1[i] = l[size_t(i)];
        ops::cuda::router_scores(nullptr, fn, s1.data(), a1.data(), l.data(), T, E);
        ops::cuda::router_scores(nullptr, fn, y1.data(), nullptr, y1.data(), T, E);
        s = s1;
        a = a1;
        y = y1;
        std::vector<unsigned char> out = bytes_of(s1.data(), size_t(T * E));
        for (const Guarded<double>* g : {&a1, &y1}) {
          const std::vector<unsigned char> b = bytes_of(g->data(), size_t(T * E));
          out.insert(out.end(), b.begin(), b.end());
        }
        return out;
      });
      EXPECT_EQ(diff, "");
      EXPECT_TRUE(s.intact() && a.intact() && y.intact()) << "written outside the elements";
      if (fn == ScoreFn::Softmax) {
        expect_close(s, s_ref, "scores");
        expect_close(a, a_ref, "aux scores");
        expect_close(y, s_ref, "scores in place");
      } else {
        expect_bitwise(s, s_ref, "scores");
        expect_bitwise(a, a_ref, "aux scores");
        expect_bitwise(y, s_ref, "scores in place");
      }
    }
  }
}

TEST(EmuKernelsRouterScores, AuxScoresBackwardMatchesTheReferenceInEveryOrder) {
  uint32_t seed = 400;
  for (ScoreFn fn : kFns) {
    for (auto [T, E] : kShapes) {
      SCOPED_TRACE("fn=" + std::to_string(int(fn)) + " tokens=" + std::to_string(T) +
                   " E=" + std::to_string(E));
      const std::vector<double> l = random_vec<double>(T * E, seed++, -4, 4);
      std::vector<double> s(size_t(T * E)), a(size_t(T * E));
      ops::router_scores_ref(fn, s.data(), a.data(), l.data(), T, E);
      const std::vector<double> daux0 = random_vec<double>(T * E, seed++);
      const std::vector<double> dl0 = random_vec<double>(T * E, seed++);
      std::vector<double> dl_ref = dl0, daux_ref = daux0;
      ops::aux_scores_backward_ref(fn, dl_ref.data(), daux_ref.data(), a.data(), s.data(), l.data(),
                                   T, E);
      Guarded<double> dl(T * E), daux(T * E);
      const std::string diff = order_dependence([&] {
        Guarded<double> dl1(T * E), daux1(T * E);
        for (int64_t i = 0; i < T * E; ++i) dl1[i] = dl0[size_t(i)];
        for (int64_t i = 0; i < T * E; ++i) daux1[i] = daux0[size_t(i)];
        ops::cuda::aux_scores_backward(nullptr, fn, dl1.data(), daux1.data(), a.data(), s.data(),
                                       l.data(), T, E);
        dl = dl1;
        daux = daux1;
        return bytes_of(dl1.data(), size_t(T * E));
      });
      EXPECT_EQ(diff, "");
      EXPECT_TRUE(dl.intact()) << "dlogits written outside its elements";
      EXPECT_TRUE(daux.intact()) << "daux (scratch) written outside its elements";
      expect_close(dl, dl_ref, "dlogits");
    }
  }
}

TEST(EmuKernelsRouterScores, NoTokensAndBadArguments) {
  ops::cuda::router_scores(nullptr, ScoreFn::Softmax, nullptr, nullptr, nullptr, 0, 4);
  ops::cuda::aux_scores_backward(nullptr, ScoreFn::Sigmoid, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, 0, 4);
  double v = 0;
  EXPECT_THROW(ops::cuda::router_scores(nullptr, ScoreFn::Sigmoid, &v, &v, &v, 1, 0), Error);
  EXPECT_THROW(ops::cuda::aux_scores_backward(nullptr, ScoreFn::Softmax, &v, &v, &v, &v, &v, -1, 2),
               Error);
}

}  // namespace
}  // namespace moecore
