// Every differentiable router path against f64 central finite differences: each score
// function, group-limited selection, expert bias, quantile offsets, Sinkhorn selection,
// capacity dropping (dropped slots carry no gradient), input jitter, and every aux-loss type
// alone and together with the z-loss. Loss = sum(probs * R) + aux_loss + z_loss.
#include <gtest/gtest.h>

#include <functional>

#include "common/layer_testing.h"
#include "moe/router.h"

namespace moecore::moe {

using testing::host;
namespace {

using testing::random_vec;

struct GradCase {
  const char* name;
  int64_t E, K, T, B;
  std::function<void(RouterConfig&)> setup;
  bool previous_micro = false;  // run one micro-batch before the checked one (global_aux_loss)
  bool expect_drops = false;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

class RouterGradients : public ::testing::TestWithParam<GradCase> {};

TEST_P(RouterGradients, MatchFiniteDifferences) {
  const GradCase c = GetParam();
  const int64_t H = 5;
  RouterConfig cfg;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.seed = 7;
  c.setup(cfg);
  ParamRegistry params(DType::F64);
  Router<double> router(cfg, H, 0.6, params, "decoder.layers.2.mlp");
  Arena arena;
  testing::plan_layer(arena, params, 5, [&](Arena& a) { router.allocate(a, c.T); });
  if (cfg.enable_expert_bias) {
    for (int64_t e = 0; e < c.E; ++e)
      host(router.expert_bias())[e] = 0.03f * static_cast<float>(e % 4) - 0.04f;
  }
  if (cfg.uses(LoadBalancing::QuantileBalancing)) {
    for (int64_t e = 0; e < c.E; ++e)
      host(router.quantile_beta())[e] = 0.1f * static_cast<float>(e % 3) - 0.1f;
  }
  const double lo = c.expect_drops ? 0.0 : -1.0;  // positive inputs skew the load
  auto x = random_vec<double>(c.T * H, 11, lo, 1.0);
  auto x_prev = random_vec<double>(c.T * H, 12, lo, 1.0);
  auto R = random_vec<double>(c.T * c.K, 13);
  const int64_t S = c.T / c.B;
  auto loss = [&] {
    router.reset_step();  // same jitter draws and accumulators for every evaluation
    if (c.previous_micro) router.forward(x_prev.data(), c.T, S);
    router.forward(x.data(), c.T, S);
    return testing::weighted_sum(host(router.saved().probs_TK), R) + router.aux_loss() +
           router.z_loss();
  };
  std::vector<double> dx(c.T * H, 0.0);
  EXPECT_TRUE(testing::check_layer_gradients(
      params, loss, [&] { router.backward(dx.data(), R.data(), 1.0); },
      {{x.data(), dx.data(), c.T * H, "dx"}}, 64));
  loss();
  if (c.expect_drops) {
    EXPECT_GT(router.dropped(), 0) << "the case must really drop";
  }
}

using LB = LoadBalancing;

INSTANTIATE_TEST_SUITE_P(
    Modes, RouterGradients,
    ::testing::Values(
        GradCase{"sqrtsoftplus_k3_scaled_aux_z", 8, 3, 9, 1,
                 [](RouterConfig& c) {
                   c.score = ScoreFunction::SqrtSoftplus;
                   c.topk_scaling_factor = 2.5;
                   c.aux_loss_coeff = 0.1;
                   c.z_loss_coeff = 0.01;
                 }},
        GradCase{"sqrtsoftplus_top1_aux", 4, 1, 7, 1,
                 [](RouterConfig& c) {
                   c.score = ScoreFunction::SqrtSoftplus;
                   c.aux_loss_coeff = 0.1;
                 }},
        GradCase{"group_softmax", 8, 2, 9, 1,
                 [](RouterConfig& c) {
                   c.num_groups = 4;
                   c.group_topk = 2;
                   c.aux_loss_coeff = 0.1;
                 }},
        GradCase{"group_pre_softmax", 12, 2, 8, 1,
                 [](RouterConfig& c) {
                   c.pre_softmax = true;
                   c.num_groups = 3;
                   c.group_topk = 1;
                   c.z_loss_coeff = 0.01;
                 }},
        GradCase{"deepseek_v3_like", 16, 4, 10, 2,
                 [](RouterConfig& c) {
                   c.score = ScoreFunction::Sigmoid;
                   c.topk_scaling_factor = 2.5;
                   c.num_groups = 4;
                   c.group_topk = 2;
                   c.enable_expert_bias = true;
                   c.load_balancing = LB::SeqAuxLoss;
                   c.aux_loss_coeff = 0.01;
                 }},
        GradCase{"bias_megatron_map", 8, 2, 9, 1,
                 [](RouterConfig& c) {
                   c.score = ScoreFunction::Sigmoid;
                   c.enable_expert_bias = true;
                   c.megatron_aux_map = true;
                   c.aux_loss_coeff = 0.1;
                 }},
        GradCase{"seq_aux_b3", 6, 2, 12, 3,
                 [](RouterConfig& c) {
                   c.load_balancing = LB::SeqAuxLoss;
                   c.aux_loss_coeff = 0.1;
                 }},
        GradCase{"global_aux_after_a_micro_batch", 8, 2, 9, 1,
                 [](RouterConfig& c) {
                   c.score = ScoreFunction::Sigmoid;
                   c.load_balancing = LB::GlobalAuxLoss;
                   c.aux_loss_coeff = 0.1;
                 },
                 true},
        GradCase{"three_aux_types_and_z", 6, 3, 8, 2,
                 [](RouterConfig& c) {
                   c.aux_loss_coeff = 0.05;
                   c.extra_load_balancing = {{LB::SeqAuxLoss, 0.02}, {LB::GlobalAuxLoss, 0.03}};
                   c.z_loss_coeff = 0.01;
                 },
                 true},
        GradCase{"sinkhorn_top1", 6, 1, 10, 1,
                 [](RouterConfig& c) { c.load_balancing = LB::Sinkhorn; }},
        GradCase{"sinkhorn_k2_z", 8, 2, 12, 1,
                 [](RouterConfig& c) {
                   c.load_balancing = LB::Sinkhorn;
                   c.z_loss_coeff = 0.01;
                 }},
        GradCase{"capacity_probs_drop", 4, 2, 10, 1,
                 [](RouterConfig& c) {
                   c.capacity_factor = 1.0;
                   c.aux_loss_coeff = 0.1;
                 },
                 false, true},
        GradCase{"capacity_position_pad_sigmoid", 5, 2, 11, 1,
                 [](RouterConfig& c) {
                   c.score = ScoreFunction::Sigmoid;
                   c.topk_scaling_factor = 2.0;
                   c.capacity_factor = 0.8;
                   c.drop_policy = TokenDropPolicy::Position;
                   c.pad_to_capacity = true;
                   c.z_loss_coeff = 0.01;
                 },
                 false, true},
        GradCase{"quantile_softmax", 8, 2, 12, 1,
                 [](RouterConfig& c) { c.load_balancing = LB::QuantileBalancing; }},
        GradCase{"quantile_pre_softmax", 8, 2, 12, 1,
                 [](RouterConfig& c) {
                   c.load_balancing = LB::QuantileBalancing;
                   c.pre_softmax = true;
                   c.z_loss_coeff = 0.01;
                 }},
        GradCase{"quantile_sigmoid_top1", 4, 1, 8, 1,
                 [](RouterConfig& c) {
                   c.load_balancing = LB::QuantileBalancing;
                   c.score = ScoreFunction::Sigmoid;
                 }},
        GradCase{"input_jitter_aux_z", 6, 2, 9, 1,
                 [](RouterConfig& c) {
                   c.input_jitter_eps = 0.05;
                   c.aux_loss_coeff = 0.1;
                   c.z_loss_coeff = 0.01;
                 }}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace moecore::moe
