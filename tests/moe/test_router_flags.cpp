// Router flags: Megatron's names and meanings, list-valued load balancing with one coefficient
// per type, and clear errors before anything is allocated.
#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/check.h"
#include "common/tiny_train_flags.h"
#include "cli/train_flags.h"

namespace moecore::cli {
namespace {

TrainFlags parse(std::vector<std::string> args) {
  TrainFlags f = tiny_train_flags();
  CLI::App app;
  add_train_flags(app, f);
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments in reverse order
  app.parse(args);
  finalize_train_flags(f);
  return f;
}

TEST(RouterFlags, DeepSeekV3StyleFlags) {
  TrainFlags f = parse({"--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                        "--moe-router-bias-update-rate", "0.002", "--moe-router-num-groups", "4",
                        "--moe-router-group-topk", "2", "--moe-router-topk", "4",
                        "--moe-router-topk-scaling-factor", "2.5",
                        "--moe-router-load-balancing-type", "seq_aux_loss",
                        "--moe-aux-loss-coeff", "0.0001", "--moe-router-dtype", "fp64"});
  const RouterConfig& r = f.model.moe.router;
  EXPECT_EQ(r.score, ScoreFunction::Sigmoid);
  EXPECT_TRUE(r.enable_expert_bias);
  EXPECT_DOUBLE_EQ(r.bias_update_rate, 0.002);
  EXPECT_EQ(r.num_groups, 4);
  EXPECT_EQ(r.group_topk, 2);
  EXPECT_EQ(r.topk, 4);
  EXPECT_DOUBLE_EQ(r.topk_scaling_factor, 2.5);
  EXPECT_EQ(r.load_balancing, LoadBalancing::SeqAuxLoss);
  EXPECT_DOUBLE_EQ(r.aux_loss_coeff, 1e-4);
  EXPECT_EQ(r.dtype, RouterDType::F64);
}

TEST(RouterFlags, SeveralLoadBalancingTypesEachWithItsCoeff) {
  TrainFlags f = parse({"--moe-router-load-balancing-type", "aux_loss", "global_aux_loss",
                        "--moe-aux-loss-coeff", "0.01", "0.002", "--moe-z-loss-coeff", "0.001"});
  auto terms = f.model.moe.router.load_balancing_terms();
  ASSERT_EQ(terms.size(), 2u);
  EXPECT_EQ(terms[0].type, LoadBalancing::AuxLoss);
  EXPECT_DOUBLE_EQ(terms[0].coeff, 0.01);
  EXPECT_EQ(terms[1].type, LoadBalancing::GlobalAuxLoss);
  EXPECT_DOUBLE_EQ(terms[1].coeff, 0.002);
  EXPECT_DOUBLE_EQ(f.model.moe.router.z_loss_coeff, 0.001);
}

TEST(RouterFlags, DefaultsKeepTheTinyModelsAuxCoeff) {
  TrainFlags f = parse({});
  EXPECT_EQ(f.model.moe.router.load_balancing, LoadBalancing::AuxLoss);
  EXPECT_DOUBLE_EQ(f.model.moe.router.aux_loss_coeff, tiny_train_flags().model.moe.router.aux_loss_coeff);
  EXPECT_TRUE(f.model.moe.router.dropless());
  EXPECT_EQ(f.model.moe.router.dtype, RouterDType::F32);
}

TEST(RouterFlags, CapacityFlags) {
  TrainFlags f = parse({"--moe-expert-capacity-factor", "1.25", "--moe-token-drop-policy",
                        "position", "--moe-pad-expert-input-to-capacity"});
  const RouterConfig& r = f.model.moe.router;
  EXPECT_DOUBLE_EQ(r.capacity_factor, 1.25);
  EXPECT_EQ(r.drop_policy, TokenDropPolicy::Position);
  EXPECT_TRUE(r.pad_to_capacity);
  // ceil(512 * 2 / 8 * 1.25) for the tiny model's 8 x 64 tokens.
  EXPECT_EQ(r.capacity(512), 160);
  // Megatron: a negative factor means dropless.
  EXPECT_TRUE(parse({"--moe-expert-capacity-factor", "-1"}).model.moe.router.dropless());
}

void expect_error(std::vector<std::string> args, const std::string& needle) {
  try {
    parse(args);
    ADD_FAILURE() << "accepted flags that should fail with: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  } catch (const CLI::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(RouterFlags, ClearErrors) {
  expect_error({"--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"},
               "2 load-balancing types but 0 --moe-aux-loss-coeff values");
  expect_error({"--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"},
               "sinkhorn balances without a loss");
  expect_error({"--moe-router-load-balancing-type", "quantile_balancing", "aux_loss",
                "--moe-aux-loss-coeff", "0", "0.01"},
               "quantile_balancing is loss-free");
  expect_error({"--moe-router-num-groups", "3", "--moe-router-group-topk", "1"},
               "--moe-router-num-groups=3 must divide num_experts=8");
  expect_error({"--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                "--moe-router-topk", "3"},
               "must be divisible by --moe-router-group-topk=2");
  expect_error({"--moe-router-load-balancing-type", "fancy"}, "fancy");
  expect_error({"--moe-pad-expert-input-to-capacity"}, "needs --moe-expert-capacity-factor");
  expect_error({"--moe-token-dispatcher-type", "flex"}, "flex (DeepEP/HybridEP fused dispatch) is not implemented yet");
  expect_error({"--moe-token-dispatcher-type", "ring"}, "unknown --moe-token-dispatcher-type 'ring'");
}

TEST(RouterFlags, TokenDispatcherType) {
  EXPECT_EQ(parse({}).model.moe.dispatcher_type, DispatcherType::AlltoAll);
  EXPECT_EQ(parse({"--moe-token-dispatcher-type", "allgather"}).model.moe.dispatcher_type,
            DispatcherType::AllGather);
  EXPECT_EQ(parse({"--moe-token-dispatcher-type", "alltoall"}).model.moe.dispatcher_type,
            DispatcherType::AlltoAll);
}

}  // namespace
}  // namespace moecore::cli
