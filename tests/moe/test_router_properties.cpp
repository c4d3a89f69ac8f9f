// Router properties that hold for every mode: uniform routing logs aux exactly 1.0, seq_aux ==
// aux for one sequence, capacity keeps exactly / at most `capacity` rows, group-limited routing
// stays within group_topk groups, the expert bias moves against the load, the aux / z losses
// push on the router only with a non-zero coefficient, the loss-gradient scale is linear,
// input jitter is deterministic and training-only, bad configurations are refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "common/layer_testing.h"
#include "moe/dispatcher.h"
#include "moe/router.h"

namespace moecore::moe {

using testing::host;
namespace {

using testing::random_vec;

// A router with its own registry and arena; W_r from `seed` (std `init_std`).
template <typename T>
struct RouterRig {
  ParamRegistry params{DTypeOf<T>::value};
  Router<T> router;
  Arena arena;
  RouterRig(const RouterConfig& cfg, int64_t H, int64_t max_tokens, double init_std = 0.5,
            uint64_t seed = 3)
      : router(cfg, H, init_std, params, "decoder.layers.1.mlp") {
    testing::plan_layer(arena, params, seed, [&](Arena& a) { router.allocate(a, max_tokens); });
  }
  T* weight() {
    return host(params.get("decoder.layers.1.mlp.router.weight").template data_as<T>());
  }
  T* weight_grad() {
    return params.get("decoder.layers.1.mlp.router.weight").template grad_as<T>();
  }
};

RouterConfig base_config(int64_t E, int64_t K) {
  RouterConfig cfg;
  cfg.num_experts = E;
  cfg.topk = K;
  return cfg;
}

// With W_r = 0 every score is the same, so P_i = T / E whatever the map and
// E / (K T^2) * sum_i P_i N_i = E / (K T^2) * (T / E) * T K = 1 exactly (powers of two).
TEST(RouterProperties, UniformRoutingLogsAuxExactlyOneForEveryType) {
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid,
                              ScoreFunction::SqrtSoftplus}) {
    for (bool megatron_map : {false, true}) {
      RouterConfig cfg = base_config(8, 2);
      cfg.score = score;
      cfg.load_balancing = LoadBalancing::AuxLoss;
      cfg.aux_loss_coeff = 0.01;
      cfg.extra_load_balancing = {{LoadBalancing::SeqAuxLoss, 0.001},
                                  {LoadBalancing::GlobalAuxLoss, 0.002}};
      cfg.megatron_aux_map = megatron_map;
      RouterRig<float> rig(cfg, 4, 32);
      std::memset(rig.weight(), 0, sizeof(float) * 32);
      SCOPED_TRACE(score_function_name(score));
      for (int micro = 0; micro < 3; ++micro) {  // global_aux_loss accumulates over these
        auto x = random_vec<float>(32 * 4, 5 + micro);
        rig.router.forward(x.data(), 32, 8);  // 4 sequences of 8
        const Router<float>& r = rig.router;
        // sqrt(softplus(0)) is irrational: its normalisation 1/E is a rounding off exact.
        const double tol = score == ScoreFunction::SqrtSoftplus ? 1e-15 : 0.0;
        for (int i = 0; i < 3; ++i) EXPECT_NEAR(r.lb_value(i), 1.0, tol) << "type " << i;
        EXPECT_NEAR(r.aux_value(), 1.0, tol);
        EXPECT_NEAR(r.aux_loss(), 0.013, 1e-15);
      }
    }
  }
}

TEST(RouterProperties, SeqAuxEqualsAuxWithOneSequence) {
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
    auto run = [&](LoadBalancing lb, std::vector<double>* dlogits) {
      RouterConfig cfg = base_config(6, 2);
      cfg.score = score;
      cfg.load_balancing = lb;
      cfg.aux_loss_coeff = 0.1;
      RouterRig<double> rig(cfg, 5, 11);
      auto x = random_vec<double>(11 * 5, 7);
      rig.router.forward(x.data(), 11, 11);
      std::vector<double> dprobs(11 * 2, 0.0), dx(11 * 5, 0.0);
      rig.router.backward(dx.data(), dprobs.data(), 1.0);
      dlogits->assign(host(rig.router.dlogits_TE()), host(rig.router.dlogits_TE()) + 66);
      return rig.router.aux_value();
    };
    std::vector<double> g_aux, g_seq;
    const double aux = run(LoadBalancing::AuxLoss, &g_aux);
    const double seq = run(LoadBalancing::SeqAuxLoss, &g_seq);
    EXPECT_NEAR(seq, aux, 1e-15);
    EXPECT_TRUE(testing::all_close(g_seq, g_aux, testing::kF64Rtol, testing::kF64Atol));
  }
}

// Random skewed routing through router + local dispatcher: with padding every expert has
// exactly `capacity` rows (pad rows: zero input, prob 0), without at most `capacity`.
TEST(RouterProperties, CapacityKeepsExactlyCapacityRowsWithPadAtMostWithout) {
  struct Case {
    int64_t E, K, T;
    double cf;
    TokenDropPolicy policy;
  };
  for (Case c : {Case{4, 2, 10, 1.0, TokenDropPolicy::Probs},
                 Case{4, 2, 10, 1.0, TokenDropPolicy::Position},
                 Case{8, 1, 13, 0.5, TokenDropPolicy::Probs},
                 Case{5, 3, 7, 2.0, TokenDropPolicy::Position},  // capacity > T: nothing drops
                 Case{6, 6, 9, 0.75, TokenDropPolicy::Probs}}) {
    for (bool pad : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "E=" << c.E << " K=" << c.K << " T=" << c.T
                                        << " cf=" << c.cf << " pad=" << pad);
      RouterConfig cfg = base_config(c.E, c.K);
      cfg.pre_softmax = c.K == 1;
      cfg.capacity_factor = c.cf;
      cfg.drop_policy = c.policy;
      cfg.pad_to_capacity = pad;
      const int64_t H = 3;
      ParamRegistry params(DType::F64);
      Router<double> router(cfg, H, 0.8, params, "r");
      LocalDispatcher<double> disp(c.E, c.K, H, pad ? c.cf : 0.0);
      Arena arena;
      testing::plan_layer(arena, params, 13, [&](Arena& a) {
        router.allocate(a, c.T);
        disp.allocate(a, c.T);
      });
      auto x = random_vec<double>(c.T * H, 17, 0.0, 1.0);  // positive: skews the load
      router.forward(x.data(), c.T);
      const auto& s = router.saved();
      const int64_t cap = cfg.capacity(c.T);
      EXPECT_EQ(s.capacity, cap);
      int64_t kept = 0;
      for (int64_t e = 0; e < c.E; ++e) {
        EXPECT_LE(host(s.tokens_per_expert_E)[e], cap) << "expert " << e;
        kept += host(s.tokens_per_expert_E)[e];
      }
      EXPECT_EQ(kept + router.dropped(), c.T * c.K);
      const DispatchPlan& p = disp.plan(s.idx_TK, c.T, pad ? s.capacity : 0);
      std::vector<double> x_NH(disp.max_rows(c.T) * H, -1.0), p_N(disp.max_rows(c.T), -1.0);
      disp.dispatch(x_NH.data(), p_N.data(), x.data(), s.probs_TK);
      for (int64_t e = 0; e < c.E; ++e) {
        if (pad)
          EXPECT_EQ(host(p.tokens_per_expert_L)[e], cap) << "expert " << e;
        else
          EXPECT_EQ(host(p.tokens_per_expert_L)[e], host(s.tokens_per_expert_E)[e])
              << "expert " << e;
      }
      // Dispatched: E * cap rows padded, else all T * K (the dropped slots' rows are zero).
      EXPECT_EQ(p.n_rows, pad ? c.E * cap : c.T * c.K);
      EXPECT_EQ(*host(p.pad_rows), pad ? c.E * cap - kept : 0);
      int64_t token_rows = 0;
      for (int64_t r = 0; r < p.n_rows; ++r) token_rows += host(p.row_token_N)[r] >= 0;
      EXPECT_EQ(token_rows, kept) << "rows that carry a token";
      for (int64_t r = 0; r < p.n_rows; ++r) {
        if (host(p.row_token_N)[r] >= 0) continue;
        EXPECT_EQ(p_N[r], 0.0);
        for (int64_t h = 0; h < H; ++h) EXPECT_EQ(x_NH[r * H + h], 0.0);
      }
      // Combine of the dispatched rows returns sum_k x over the kept slots, pads or not.
      std::vector<double> y(c.T * H);
      disp.combine(y.data(), x_NH.data());
      for (int64_t t = 0; t < c.T; ++t) {
        int64_t n_kept = 0;
        for (int64_t k = 0; k < c.K; ++k) n_kept += host(s.idx_TK)[t * c.K + k] >= 0;
        for (int64_t h = 0; h < H; ++h) EXPECT_DOUBLE_EQ(y[t * H + h], n_kept * x[t * H + h]);
      }
    }
  }
}

// Capacity groups (RouterConfig::capacity_groups, the one-rank model of TP ranks routing their
// sequence slices): the router on all T tokens with G groups keeps, drops and weighs exactly what
// G routers of the same weights keep on the G contiguous slices alone, each with capacity(T / G);
// the dropped pairs are the slices' sum. Padding with several groups and token counts that do not
// split evenly are refused.
TEST(RouterProperties, CapacityGroupsRouteEachSliceWithItsOwnCapacity) {
  const int64_t E = 8, K = 2, H = 4, T = 24;
  for (int64_t G : {2, 3, 4}) {
    for (TokenDropPolicy policy : {TokenDropPolicy::Probs, TokenDropPolicy::Position}) {
      SCOPED_TRACE(::testing::Message() << "groups " << G << " policy "
                                        << static_cast<int>(policy));
      RouterConfig cfg = base_config(E, K);
      cfg.capacity_factor = 1.0;
      cfg.drop_policy = policy;
      RouterRig<double> slice(cfg, H, T);
      cfg.capacity_groups = G;
      RouterRig<double> whole(cfg, H, T);
      const auto x = random_vec<double>(T * H, 29, 0.0, 1.0);  // positive: skews the load
      whole.router.forward(x.data(), T);
      const RouterSaved<double>& w = whole.router.saved();
      const int64_t n = T / G;
      EXPECT_EQ(w.capacity, cfg.capacity(n));
      const std::vector<int32_t> idx(host(w.idx_TK), host(w.idx_TK) + T * K);
      const std::vector<double> probs(host(w.probs_TK), host(w.probs_TK) + T * K);
      int64_t dropped = 0;
      for (int64_t g = 0; g < G; ++g) {
        slice.router.forward(x.data() + g * n * H, n);
        const RouterSaved<double>& s = slice.router.saved();
        for (int64_t i = 0; i < n * K; ++i) {
          EXPECT_EQ(idx[g * n * K + i], host(s.idx_TK)[i]) << "slice " << g << " pair " << i;
          EXPECT_EQ(probs[g * n * K + i], host(s.probs_TK)[i]) << "slice " << g << " pair " << i;
        }
        dropped += slice.router.dropped();
      }
      EXPECT_GT(dropped, 0) << "nothing dropped: the case shows nothing";
      EXPECT_EQ(whole.router.dropped(), dropped);
    }
  }
  RouterConfig cfg = base_config(E, K);
  cfg.capacity_factor = 1.0;
  cfg.capacity_groups = 2;
  cfg.pad_to_capacity = true;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.pad_to_capacity = false;
  cfg.capacity_groups = 0;
  EXPECT_THROW(cfg.validate(), Error);
  cfg.capacity_groups = 5;
  RouterRig<double> rig(cfg, H, T);
  const auto x = random_vec<double>(T * H, 31);
  EXPECT_THROW(rig.router.forward(x.data(), T), Error);  // 24 tokens in 5 groups
}

TEST(RouterProperties, GroupLimitedRoutingUsesAtMostGroupTopkGroups) {
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
    RouterConfig cfg = base_config(16, 4);
    cfg.score = score;
    cfg.num_groups = 8;
    cfg.group_topk = 2;
    cfg.enable_expert_bias = score == ScoreFunction::Sigmoid;
    RouterRig<float> rig(cfg, 8, 200, 1.0);
    if (cfg.enable_expert_bias) {
      for (int e = 0; e < 16; ++e)
        host(rig.router.expert_bias())[e] = 0.05f * static_cast<float>(e % 5);
    }
    auto x = random_vec<float>(200 * 8, 21);
    rig.router.forward(x.data(), 200);
    const auto& s = rig.router.saved();
    std::set<int> groups_used;
    for (int64_t t = 0; t < 200; ++t) {
      std::set<int> groups;
      for (int64_t k = 0; k < 4; ++k) groups.insert(host(s.idx_TK)[t * 4 + k] / 2);
      EXPECT_LE(groups.size(), 2u) << "token " << t;
      groups_used.insert(groups.begin(), groups.end());
    }
    EXPECT_EQ(groups_used.size(), 8u);  // the limit is per token, not global
  }
}

TEST(RouterProperties, ExpertBiasMovesUnderLoadedUpAndOverLoadedDown) {
  RouterConfig cfg = base_config(8, 2);
  cfg.score = ScoreFunction::Sigmoid;
  cfg.enable_expert_bias = true;
  cfg.load_balancing = LoadBalancing::None;
  cfg.bias_update_rate = 0.01;
  RouterRig<double> rig(cfg, 4, 40, 1.0);
  auto x1 = random_vec<double>(40 * 4, 31, 0.0, 1.0);
  auto x2 = random_vec<double>(40 * 4, 32, 0.0, 1.0);
  std::vector<int64_t> counts(8, 0);
  rig.router.forward(x1.data(), 40);
  for (int e = 0; e < 8; ++e) counts[e] += host(rig.router.saved().tokens_per_expert_E)[e];
  rig.router.forward(x2.data(), 40);
  for (int e = 0; e < 8; ++e) counts[e] += host(rig.router.saved().tokens_per_expert_E)[e];
  rig.router.set_training(false);  // eval forwards do not count
  rig.router.forward(x2.data(), 40);
  rig.router.set_training(true);
  // The all-reduce hook sees the step's counts (both training micro-batches, nothing else).
  RouterStepSync sync;
  int calls = 0;
  sync.sum_tp_dp_cp = [&](DevPtr<double> c, int64_t n) {
    ++calls;
    ASSERT_EQ(n, 8);
    for (int e = 0; e < 8; ++e) EXPECT_EQ(host(c)[e], static_cast<double>(counts[e])) << e;
  };
  rig.router.finish_step(sync);
  EXPECT_EQ(calls, 1);
  const double mean = 160.0 * 2 / 8;
  int up = 0, down = 0;
  for (int e = 0; e < 8; ++e) {
    const float b = host(rig.router.expert_bias())[e];
    const float want = counts[e] < mean ? 0.01f : (counts[e] > mean ? -0.01f : 0.0f);
    EXPECT_EQ(b, want) << "expert " << e << " with " << counts[e] << " tokens, mean " << mean;
    up += counts[e] < mean;
    down += counts[e] > mean;
  }
  EXPECT_GT(up, 0);
  EXPECT_GT(down, 0);
  // The bias changes the selection, never the probs of a chosen expert.
  rig.router.forward(x1.data(), 40);
  const auto& s = rig.router.saved();
  for (int64_t t = 0; t < 40; ++t) {
    const double a = host(s.scores_TE)[t * 8 + host(s.idx_TK)[t * 2]],
                 b = host(s.scores_TE)[t * 8 + host(s.idx_TK)[t * 2 + 1]];
    EXPECT_NEAR(host(s.probs_TK)[t * 2], a / (a + b), 1e-15);
  }
  // Nothing counted since the reset: a second finish_step leaves the bias alone.
  std::vector<float> before(host(rig.router.expert_bias()), host(rig.router.expert_bias()) + 8);
  rig.router.reset_step();
  rig.router.finish_step();
  EXPECT_EQ(std::vector<float>(host(rig.router.expert_bias()), host(rig.router.expert_bias()) + 8),
            before);
}

TEST(RouterProperties, QuantileBetaBalancesARepeatedBatch) {
  RouterConfig cfg = base_config(8, 2);
  cfg.load_balancing = LoadBalancing::QuantileBalancing;
  RouterRig<double> rig(cfg, 6, 64, 1.0);
  auto x = random_vec<double>(64 * 6, 41, 0.0, 1.0);
  rig.router.forward(x.data(), 64);
  const double before = rig.router.stats().max_over_mean_load;
  for (int step = 0; step < 5; ++step) {
    rig.router.finish_step();
    rig.router.forward(x.data(), 64);
  }
  const double after = rig.router.stats().max_over_mean_load;
  EXPECT_GT(before, 1.5);
  EXPECT_LT(after, 1.3);
  double mean = 0;
  for (int e = 0; e < 8; ++e) mean += host(rig.router.quantile_beta())[e];
  EXPECT_NEAR(mean / 8, 0.0, 1e-6);  // centred
}

TEST(RouterProperties, RejectsTokenCountsQuantileCannotSplit) {
  RouterConfig cfg = base_config(8, 3);
  cfg.load_balancing = LoadBalancing::QuantileBalancing;
  ParamRegistry params(DType::F32);
  Router<float> router(cfg, 4, 0.02, params, "r");
  Arena arena;
  try {
    arena.plan([&](Arena& a) { router.allocate(a, 10); });  // 10 * 3 % 8 != 0
    FAIL() << "accepted T*K not divisible by E";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("10 * 3 % 8"), std::string::npos) << e.what();
  }
}

// Each aux type and the z-loss push on the router (zero dprobs) iff its coefficient is > 0.
TEST(RouterProperties, AuxAndZGradientOnlyWithNonZeroCoeff) {
  for (LoadBalancing lb : {LoadBalancing::AuxLoss, LoadBalancing::SeqAuxLoss,
                           LoadBalancing::GlobalAuxLoss, LoadBalancing::None}) {
    for (double coeff : {0.0, 0.1}) {
      for (double z : {0.0, 0.01}) {
        for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::SqrtSoftplus}) {
          RouterConfig cfg = base_config(5, 2);
          cfg.score = score;
          cfg.load_balancing = lb;
          cfg.aux_loss_coeff = lb == LoadBalancing::None ? 0.0 : coeff;
          cfg.z_loss_coeff = z;
          RouterRig<double> rig(cfg, 3, 12);
          auto x = random_vec<double>(36, 1);
          rig.router.forward(x.data(), 12, 6);
          std::vector<double> zero(24, 0.0), dx(36, 0.0);
          rig.router.backward(dx.data(), zero.data(), 1.0);
          double norm = 0;
          for (double v : dx) norm += v * v;
          const bool expect = cfg.aux_loss_coeff > 0 || z > 0;
          SCOPED_TRACE(::testing::Message() << load_balancing_name(lb) << " coeff=" << coeff
                                            << " z=" << z << " " << score_function_name(score));
          if (expect) EXPECT_GT(norm, 0.0);
          else EXPECT_EQ(norm, 0.0);
        }
      }
    }
  }
}

// Megatron's MoEAuxLossAutoScaler: the aux / z gradient is the loss gradient times the scale
// (1 / micro-batches); the probs gradient is not scaled.
TEST(RouterProperties, LossGradScaleMultipliesOnlyAuxAndZ) {
  RouterConfig cfg = base_config(6, 2);
  cfg.aux_loss_coeff = 0.1;
  cfg.z_loss_coeff = 0.01;
  RouterRig<double> rig(cfg, 4, 9);
  auto x = random_vec<double>(36, 3);
  auto dp = random_vec<double>(18, 4);
  std::vector<double> zero(18, 0.0), dx(36);
  rig.router.forward(x.data(), 9);
  auto dl = [&](const std::vector<double>& dprobs, double scale) {
    rig.router.backward(dx.data(), dprobs.data(), scale);
    return std::vector<double>(host(rig.router.dlogits_TE()), host(rig.router.dlogits_TE()) + 54);
  };
  auto probs_only = dl(dp, 0.0), losses1 = dl(zero, 1.0), both = dl(dp, 0.25);
  for (int i = 0; i < 54; ++i) {
    EXPECT_NEAR(both[i], probs_only[i] + 0.25 * losses1[i], 1e-15) << i;
  }
}

TEST(RouterProperties, InputJitterIsDeterministicAndTrainingOnly) {
  RouterConfig cfg = base_config(8, 2);
  cfg.input_jitter_eps = 0.1;
  cfg.seed = 99;
  RouterRig<float> rig(cfg, 4, 16);
  auto x = random_vec<float>(64, 8);
  auto logits = [&] {
    rig.router.forward(x.data(), 16);
    return std::vector<double>(host(rig.router.saved().logits_TE),
                               host(rig.router.saved().logits_TE) + 128);
  };
  auto a = logits();              // step 0, micro 0
  auto b = logits();              // step 0, micro 1
  rig.router.reset_step();
  auto a2 = logits();             // step 0, micro 0 again
  rig.router.finish_step();
  auto c = logits();              // step 1, micro 0
  EXPECT_EQ(a, a2);
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  const float* j = host(rig.router.saved().jitter_TH);
  ASSERT_NE(j, nullptr);
  for (int i = 0; i < 64; ++i) {
    EXPECT_GE(j[i], 0.9f);
    EXPECT_LE(j[i], 1.1f);
  }
  rig.router.set_training(false);
  auto e1 = logits(), e2 = logits();
  EXPECT_EQ(e1, e2);
  EXPECT_EQ(rig.router.saved().jitter_TH, nullptr);
  for (int t = 0; t < 16; ++t) {
    for (int e = 0; e < 8; ++e) {
      double acc = 0;
      for (int h = 0; h < 4; ++h) acc += double(x[t * 4 + h]) * rig.weight()[e * 4 + h];
      EXPECT_NEAR(e1[t * 8 + e], acc, 1e-5);
    }
  }
}

void expect_rejected(const RouterConfig& cfg, const std::string& needle) {
  try {
    cfg.validate();
    ADD_FAILURE() << "accepted a config that needs: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[router]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(RouterProperties, RejectsImpossibleCombinationsByName) {
  RouterConfig q = base_config(8, 2);
  q.load_balancing = LoadBalancing::QuantileBalancing;
  EXPECT_NO_THROW(q.validate());
  RouterConfig q_aux = q;
  q_aux.extra_load_balancing = {{LoadBalancing::AuxLoss, 0.01}};
  expect_rejected(q_aux, "aux_loss with --moe-aux-loss-coeff=0.01");
  RouterConfig q_group = q;
  q_group.num_groups = 4;
  q_group.group_topk = 2;
  expect_rejected(q_group, "quantile_balancing does not support group-limited routing");
  RouterConfig q_topk = base_config(4, 4);
  q_topk.load_balancing = LoadBalancing::QuantileBalancing;
  expect_rejected(q_topk, "--moe-router-topk=4 must be < num_experts=4");

  RouterConfig g = base_config(8, 3);
  g.num_groups = 4;
  g.group_topk = 2;
  expect_rejected(g, "--moe-router-topk=3 must be divisible by --moe-router-group-topk=2");
  RouterConfig g2 = base_config(9, 2);
  g2.num_groups = 4;
  g2.group_topk = 2;
  expect_rejected(g2, "--moe-router-num-groups=4 must divide num_experts=9");
  RouterConfig g3 = base_config(8, 2);
  g3.num_groups = 4;
  expect_rejected(g3, "needs both --moe-router-num-groups and --moe-router-group-topk");

  RouterConfig sk = base_config(8, 2);
  sk.load_balancing = LoadBalancing::Sinkhorn;
  EXPECT_NO_THROW(sk.validate());
  sk.aux_loss_coeff = 0.01;
  expect_rejected(sk, "sinkhorn balances without a loss but its --moe-aux-loss-coeff is 0.01");

  RouterConfig b = base_config(8, 2);
  b.enable_expert_bias = true;
  expect_rejected(b, "needs --moe-router-score-function sigmoid or sqrtsoftplus (got softmax)");
  RouterConfig pad = base_config(8, 2);
  pad.pad_to_capacity = true;
  expect_rejected(pad, "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  RouterConfig dup = base_config(8, 2);
  dup.extra_load_balancing = {{LoadBalancing::AuxLoss, 0.1}};
  expect_rejected(dup, "lists aux_loss twice");
}

}  // namespace
}  // namespace moecore::moe
