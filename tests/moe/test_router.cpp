// Router: every score mode's backward (probs, aux loss, z-loss) against fp64 finite
// differences; the logged aux value is exactly 1.0 for uniform routing; bad configs rejected.
#include <gtest/gtest.h>

#include <cstring>

#include "common/layer_testing.h"
#include "moe/router.h"

namespace moecore::moe {

using testing::host;
namespace {

using testing::check_gradient;
using testing::random_vec;

struct RouterCase {
  const char* name;
  ScoreFunction score;
  bool pre_softmax;
  int64_t E, K;
  double scaling, aux, z;
};

void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }

class RouterGrad : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouterGrad, MatchesFiniteDifferences) {
  const RouterCase c = GetParam();
  const int64_t n_tok = 7, H = 5;
  RouterConfig cfg;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.score = c.score;
  cfg.pre_softmax = c.pre_softmax;
  cfg.topk_scaling_factor = c.scaling;
  cfg.aux_loss_coeff = c.aux;
  cfg.z_loss_coeff = c.z;
  ParamRegistry params(DType::F64);
  Router<double> router(cfg, H, 0.5, params, "r");
  Arena arena;
  testing::plan_layer(arena, params, 3, [&](Arena& a) { router.allocate(a, n_tok); });
  auto x = random_vec<double>(n_tok * H, 11);
  auto R = random_vec<double>(n_tok * c.K, 12);
  auto loss = [&] {
    router.forward(x.data(), n_tok);
    return testing::weighted_sum(host(router.saved().probs_TK), R) + router.aux_loss() +
           router.z_loss();
  };
  loss();
  std::vector<double> dx(n_tok * H, 0.0);
  params.zero_grads();
  router.backward(dx.data(), R.data(), 1.0);
  // Selection must not change under the perturbation: the FD step is far below the gaps.
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), n_tok * H, "dx", 64));
  EXPECT_TRUE(testing::check_param_gradients(params, loss, 64));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, RouterGrad,
    ::testing::Values(RouterCase{"softmax", ScoreFunction::Softmax, false, 6, 2, 1.0, 0.0, 0.0},
                      RouterCase{"softmax_aux_z", ScoreFunction::Softmax, false, 6, 3, 1.0, 0.1, 0.01},
                      RouterCase{"softmax_topk_all", ScoreFunction::Softmax, false, 4, 4, 1.0, 0.1, 0.0},
                      RouterCase{"pre_softmax_top1", ScoreFunction::Softmax, true, 5, 1, 1.0, 0.1, 0.01},
                      RouterCase{"pre_softmax_scaled", ScoreFunction::Softmax, true, 8, 2, 2.5, 0.0, 0.0},
                      RouterCase{"sigmoid", ScoreFunction::Sigmoid, false, 8, 3, 2.5, 0.1, 0.01},
                      RouterCase{"sigmoid_top1", ScoreFunction::Sigmoid, false, 4, 1, 1.0, 0.1, 0.0}),
    [](const auto& info) { return std::string(info.param.name); });

// With W_r = 0 every score is 1/E, so sum_i P_i N_i = (T/E) * T K and aux / coeff = 1 exactly.
TEST(Router, UniformRoutingLogsAuxExactlyOne) {
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
    RouterConfig cfg;
    cfg.num_experts = 8;
    cfg.topk = 2;
    cfg.score = score;
    cfg.aux_loss_coeff = 0.01;
    ParamRegistry params(DType::F32);
    Router<float> router(cfg, 4, 0.02, params, "r");
    Arena arena;
    arena.plan([&](Arena& a) {
      params.allocate(a);
      router.allocate(a, 16);
    });
    std::memset(host(params.get("r.router.weight").data), 0, sizeof(float) * 32);
    auto x = random_vec<float>(16 * 4, 5);
    router.forward(x.data(), 16);
    EXPECT_EQ(router.aux_value(), 1.0);
    EXPECT_DOUBLE_EQ(router.aux_loss(), 0.01);
  }
}

TEST(Router, AuxAndZGradientOnlyWithNonZeroCoeff) {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.topk = 2;
  ParamRegistry params(DType::F64);
  Router<double> router(cfg, 3, 0.5, params, "r");
  Arena arena;
  testing::plan_layer(arena, params, 9, [&](Arena& a) { router.allocate(a, 5); });
  auto x = random_vec<double>(15, 1);
  std::vector<double> zero_dprobs(10, 0.0), dx(15, 0.0);
  router.forward(x.data(), 5);
  EXPECT_GT(router.aux_value(), 0.0);  // computed for logging even with coeff 0
  router.backward(dx.data(), zero_dprobs.data(), 1.0);
  for (double v : dx) EXPECT_EQ(v, 0.0);
  const double* g = host(params.get("r.router.weight").grad_as<double>());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(g[i], 0.0);
}

TEST(Router, RejectsImpossibleConfigs) {
  RouterConfig cfg;
  cfg.num_experts = 8;
  cfg.topk = 9;
  try {
    cfg.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--moe-router-topk=9"), std::string::npos) << e.what();
  }
  cfg.topk = 1;  // softmax top-1 needs pre-softmax
  EXPECT_THROW(cfg.validate(), Error);
  cfg.pre_softmax = true;
  EXPECT_NO_THROW(cfg.validate());
}

}  // namespace
}  // namespace moecore::moe
