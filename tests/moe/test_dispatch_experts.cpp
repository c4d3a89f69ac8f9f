// Dispatcher and experts: dispatch then combine with probs = 1/K returns the input and its
// gradient is the identity; grouped experts equal a per-expert loop (outputs, input grad,
// prob grad, every weight and bias grad) for every activation, with and without biases,
// including experts with no tokens; f64 finite differences of the experts and of the whole MoE
// layer (GeLU with biases too), dropless and with capacity dropping and padding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "common/layer_testing.h"
#include "moe/dispatcher.h"
#include "moe/experts.h"
#include "moe/moe_layer.h"
#include "ops/gemm.h"
#include "ops/activation.h"
#include "ops/swiglu.h"

namespace moecore::moe {

using testing::host;
namespace {

using testing::all_close;
using testing::random_vec;

// Routing with awkward structure: expert 1 never chosen, expert 0 chosen by every token.
std::vector<int32_t> awkward_routing(int64_t n_tok, int64_t K, int64_t E) {
  std::vector<int32_t> idx(n_tok * K);
  for (int64_t t = 0; t < n_tok; ++t) {
    idx[t * K] = 0;
    for (int64_t k = 1; k < K; ++k) {
      int64_t e = 2 + (t * 7 + k * 3) % (E - 2);
      for (int64_t j = 0; j < k; ++j) {
        if (idx[t * K + j] == e) e = 2 + (e - 1) % (E - 2);
      }
      idx[t * K + k] = static_cast<int32_t>(e);
    }
  }
  return idx;
}

TEST(LocalDispatcher, DispatchThenCombineIsIdentity) {
  for (int64_t K : {1, 3}) {
    const int64_t n_tok = 11, E = 6, H = 5;
    LocalDispatcher<double> d(E, K, H);
    Arena arena;
    arena.plan([&](Arena& a) { d.allocate(a, n_tok); });
    auto idx = awkward_routing(n_tok, K, E);
    const DispatchPlan& plan = d.plan(idx.data(), n_tok);
    ASSERT_EQ(plan.n_rows, n_tok * K);
    EXPECT_EQ(host(plan.tokens_per_expert_L)[0], n_tok);
    EXPECT_EQ(host(plan.tokens_per_expert_L)[1], 0);
    auto x = random_vec<double>(n_tok * H, 1);
    std::vector<double> probs(n_tok * K, 1.0 / K), x_NH(n_tok * K * H), p_N(n_tok * K);
    d.dispatch(x_NH.data(), p_N.data(), x.data(), probs.data());
    // "Experts" = multiply by the row's prob.
    for (int64_t r = 0; r < plan.n_rows; ++r) {
      for (int64_t h = 0; h < H; ++h) x_NH[r * H + h] *= p_N[r];
    }
    std::vector<double> y(n_tok * H);
    d.combine(y.data(), x_NH.data());
    EXPECT_TRUE(all_close(y, x, testing::kF64FewUlps, 0));
    // Gradient: combine_backward then (prob-scaled) dispatch_backward is the identity.
    auto dy = random_vec<double>(n_tok * H, 2);
    std::vector<double> dy_NH(n_tok * K * H), dx(n_tok * H), dprobs(n_tok * K), dp(n_tok * K, 0);
    d.combine_backward(dy_NH.data(), dy.data());
    for (int64_t r = 0; r < plan.n_rows; ++r) {
      for (int64_t h = 0; h < H; ++h) dy_NH[r * H + h] *= p_N[r];
      dp[r] = 1.0 + r;
    }
    d.dispatch_backward(dx.data(), dprobs.data(), dy_NH.data(), dp.data());
    EXPECT_TRUE(all_close(dx, dy, testing::kF64FewUlps, 0));
    for (int64_t i = 0; i < n_tok * K; ++i) EXPECT_EQ(dprobs[i], 1.0 + host(plan.token_rows_TK)[i]);
  }
}

TEST(LocalDispatcher, DroppedSlotsGetNoRowAndZeroGrad) {
  const int64_t n_tok = 4, E = 3, K = 2, H = 2;
  LocalDispatcher<double> d(E, K, H);
  Arena arena;
  arena.plan([&](Arena& a) { d.allocate(a, n_tok); });
  std::vector<int32_t> idx = {0, 1, 2, -1, -1, -1, 1, 0};
  const DispatchPlan& plan = d.plan(idx.data(), n_tok);
  // All T * K rows are dispatched (a size the host knows): the 5 kept ones, then the 3 dropped
  // slots' rows, which carry no token.
  EXPECT_EQ(plan.n_rows, n_tok * K);
  for (int64_t r = 0; r < plan.n_rows; ++r) EXPECT_EQ(host(plan.row_token_N)[r] < 0, r >= 5) << r;
  std::vector<double> dx_NH(plan.n_rows * H, 1.0), dp(plan.n_rows, 3.0), dx(n_tok * H),
      dprobs(n_tok * K);
  d.dispatch_backward(dx.data(), dprobs.data(), dx_NH.data(), dp.data());
  EXPECT_EQ(dprobs[3], 0.0);
  EXPECT_EQ(dprobs[4], 0.0);
  EXPECT_EQ(dx[2 * H], 0.0);  // token 2 was dropped entirely
  EXPECT_EQ(dx[0], 2.0);      // token 0 kept both slots
}

// The per-expert loop the grouped experts must equal: plain linears, the reference activation
// (SwiGLU or element-wise) and, with biases, plain loops for b1 (added to h) and p b2 (added to
// y): db1 = sum dh, db2 = sum p dy, dp += dy . b2.
struct ExpertGrads {
  std::vector<double> y, dx, dp, dfc1, dfc2, db1, db2;
};
ExpertGrads sequential_experts(const std::vector<double>& x, const std::vector<double>& p,
                               const std::vector<double>& dy, const double* fc1, const double* fc2,
                               const double* b1, const double* b2, const std::vector<int64_t>& m,
                               int64_t H, int64_t F, ops::Activation act) {
  const int64_t E = static_cast<int64_t>(m.size()), F1 = ops::activation_fc1_width(act, F);
  int64_t N = 0;
  for (int64_t n : m) N += n;
  ExpertGrads g{std::vector<double>(N * H), std::vector<double>(N * H), std::vector<double>(N),
                std::vector<double>(E * F1 * H, 0), std::vector<double>(E * H * F, 0),
                std::vector<double>(E * F1, 0), std::vector<double>(E * H, 0)};
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = m[e];
    if (n == 0) continue;
    const double* w1 = fc1 + e * F1 * H;
    const double* w2 = fc2 + e * H * F;
    std::vector<double> h(n * F1), a(n * F), da(n * F), dh(n * F1);
    ops::linear_forward<double>(cpu_exec(), h.data(), &x[row * H], w1, n, F1, H);
    if (b1) {
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < F1; ++c) h[r * F1 + c] += b1[e * F1 + c];
    }
    if (act == ops::Activation::SwiGLU)
      ops::swiglu_forward_ref(a.data(), h.data(), &p[row], n, F);
    else
      ops::activation_forward_ref(act, a.data(), h.data(), &p[row], n, F);
    ops::linear_forward<double>(cpu_exec(), &g.y[row * H], a.data(), w2, n, H, F);
    if (b2) {
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < H; ++c) g.y[(row + r) * H + c] += p[row + r] * b2[e * H + c];
    }
    ops::linear_backward<double>(cpu_exec(), da.data(), &g.dfc2[e * H * F], &dy[row * H],
                                 a.data(), w2, n, H, F);
    if (act == ops::Activation::SwiGLU)
      ops::swiglu_backward_ref(dh.data(), &g.dp[row], da.data(), h.data(), &p[row], n, F);
    else
      ops::activation_backward_ref(act, dh.data(), &g.dp[row], da.data(), h.data(), &p[row], n, F);
    if (b1) {
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < F1; ++c) g.db1[e * F1 + c] += dh[r * F1 + c];
    }
    if (b2) {
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < H; ++c) {
          g.db2[e * H + c] += p[row + r] * dy[(row + r) * H + c];
          g.dp[row + r] += dy[(row + r) * H + c] * b2[e * H + c];
        }
      }
    }
    ops::linear_backward<double>(cpu_exec(), &g.dx[row * H], &g.dfc1[e * F1 * H], dh.data(),
                                 &x[row * H], w1, n, F1, H);
    row += n;
  }
  return g;
}

const ops::Activation kAllActs[] = {ops::Activation::SwiGLU, ops::Activation::GeLU,
                                    ops::Activation::GeLUTanh, ops::Activation::SquaredReLU};

// Sets a parameter to seeded values (biases start at zero: make them act).
void randomize(const Param& prm, uint32_t seed) {
  auto v = random_vec<double>(prm.local_numel(), seed);
  std::copy(v.begin(), v.end(), host(prm.data_as<double>()));
}

TEST(GroupedExperts, EqualsPerExpertLoopWithEmptyExperts) {
  const int64_t E = 5, H = 6, F = 3;
  const std::vector<int64_t> m = {0, 4, 0, 7, 0};  // first, middle and last expert empty
  const int64_t N = 11;
  for (ops::Activation act : kAllActs) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << ops::activation_name(act) << " bias=" << bias);
      const int64_t F1 = ops::activation_fc1_width(act, F);
      ParamRegistry params(DType::F64);
      GroupedExperts<double> experts(E, 0, E, nn::MlpShape{H, F, act, bias}, 0.3, 0.2, params,
                                     "moe");
      Arena arena;
      testing::plan_layer(arena, params, 7, [&](Arena& a) { experts.allocate(a, N); });
      ASSERT_EQ(experts.fc1_bias() != nullptr, bias);
      if (bias) {
        EXPECT_EQ(experts.fc1_bias()->spec.global_shape, (std::vector<int64_t>{E, F1}));
        EXPECT_EQ(experts.fc2_bias()->spec.global_shape, (std::vector<int64_t>{E, H}));
        EXPECT_EQ(experts.fc1_bias()->spec.kind, ParamKind::Expert);
        EXPECT_EQ(experts.fc1_bias()->name(), "moe.experts.linear_fc1.bias");
        EXPECT_EQ(experts.fc2_bias()->name(), "moe.experts.linear_fc2.bias");
        randomize(*experts.fc1_bias(), 41);
        randomize(*experts.fc2_bias(), 42);
      }
      auto x = random_vec<double>(N * H, 1);
      auto p = random_vec<double>(N, 2, 0.1, 1.0);
      auto dy = random_vec<double>(N * H, 3);
      std::vector<double> y(N * H), dx(N * H), dp(N);
      experts.forward(y.data(), x.data(), p.data(), m.data(), N);
      params.zero_grads();
      experts.backward(dx.data(), dp.data(), dy.data());

      const double* b1 = bias ? host(experts.fc1_bias()->data_as<double>()) : nullptr;
      const double* b2 = bias ? host(experts.fc2_bias()->data_as<double>()) : nullptr;
      const ExpertGrads s =
          sequential_experts(x, p, dy, host(experts.fc1().data_as<double>()),
                             host(experts.fc2().data_as<double>()), b1, b2, m, H, F, act);
      constexpr double rtol = testing::kF64Rtol, atol = testing::kF64Atol;
      EXPECT_TRUE(all_close(y, s.y, rtol, atol)) << "y";
      EXPECT_TRUE(all_close(dx, s.dx, rtol, atol)) << "dx";
      EXPECT_TRUE(all_close(dp, s.dp, rtol, atol)) << "dp";
      EXPECT_TRUE(all_close(host(experts.fc1().grad_as<double>()), s.dfc1.data(), E * F1 * H,
                            rtol, atol))
          << "dfc1";
      EXPECT_TRUE(all_close(host(experts.fc2().grad_as<double>()), s.dfc2.data(), E * H * F,
                            rtol, atol))
          << "dfc2";
      if (bias) {
        EXPECT_TRUE(all_close(host(experts.fc1_bias()->grad_as<double>()), s.db1.data(), E * F1,
                              rtol, atol))
            << "db1";
        EXPECT_TRUE(all_close(host(experts.fc2_bias()->grad_as<double>()), s.db2.data(), E * H,
                              rtol, atol))
            << "db2";
        for (int64_t i = 0; i < F1; ++i)
          EXPECT_EQ(host(experts.fc1_bias()->grad_as<double>())[i], 0.0) << "empty expert";
      }
      // Empty experts get exactly zero gradient.
      for (int64_t i = 0; i < F1 * H; ++i)
        EXPECT_EQ(host(experts.fc1().grad_as<double>())[i], 0.0);
    }
  }
}

TEST(GroupedExperts, FiniteDifferences) {
  const int64_t E = 3, H = 4, F = 3;
  const std::vector<int64_t> m = {3, 0, 2};
  const int64_t N = 5;
  for (ops::Activation act : kAllActs) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << ops::activation_name(act) << " bias=" << bias);
      ParamRegistry params(DType::F64);
      GroupedExperts<double> experts(E, 0, E, nn::MlpShape{H, F, act, bias}, 0.5, 0.5, params,
                                     "moe");
      Arena arena;
      testing::plan_layer(arena, params, 5, [&](Arena& a) { experts.allocate(a, N); });
      if (bias) {
        randomize(*experts.fc1_bias(), 43);
        randomize(*experts.fc2_bias(), 44);
      }
      auto x = random_vec<double>(N * H, 1);
      auto p = random_vec<double>(N, 2, 0.1, 1.0);
      auto R = random_vec<double>(N * H, 3);
      std::vector<double> y(N * H), dx(N * H), dp(N);
      auto loss = [&] {
        experts.forward(y.data(), x.data(), p.data(), m.data(), N);
        return testing::weighted_sum(y.data(), R);
      };
      EXPECT_TRUE(testing::check_layer_gradients(
          params, loss, [&] { experts.backward(dx.data(), dp.data(), R.data()); },
          {{x.data(), dx.data(), N * H, "dx"}, {p.data(), dp.data(), N, "dp"}}));
    }
  }
}

MoeLayerConfig tiny_moe_config(int64_t E, int64_t K, int64_t shared, ScoreFunction score,
                               bool gate = false) {
  MoeLayerConfig cfg;
  cfg.hidden = 6;
  cfg.num_experts = E;
  cfg.moe.router.num_experts = E;
  cfg.moe.router.topk = K;
  cfg.moe.router.score = score;
  cfg.moe.router.pre_softmax = K == 1;
  cfg.moe.router.aux_loss_coeff = 0.05;
  cfg.moe.router.z_loss_coeff = 0.01;
  cfg.moe.ffn_hidden = 4;
  cfg.moe.shared_ffn_hidden = shared;
  cfg.moe.shared_expert_gate = gate;
  cfg.init_std = 0.4;
  cfg.output_init_std = 0.2;  // init_std / sqrt(2 L) of a 2-layer model
  return cfg;
}

TEST(MoELayer, FiniteDifferencesEveryInputAndParameter) {
  struct Case {
    int64_t E, K, shared;
    ScoreFunction score;
    bool gate = false;  // --moe-shared-expert-gate
    ops::Activation act = ops::Activation::SwiGLU;
    bool bias = false;  // MLP biases of the experts and the shared expert
  };
  for (Case c :
       {Case{4, 2, 0, ScoreFunction::Softmax}, Case{5, 1, 3, ScoreFunction::Softmax},
        Case{6, 3, 5, ScoreFunction::Sigmoid}, Case{3, 3, 0, ScoreFunction::Softmax},
        Case{5, 2, 3, ScoreFunction::Softmax, true}, Case{6, 3, 5, ScoreFunction::Sigmoid, true},
        Case{5, 2, 3, ScoreFunction::Softmax, false, ops::Activation::GeLU, true},
        Case{4, 2, 3, ScoreFunction::Softmax, true, ops::Activation::GeLUTanh, true},
        Case{4, 1, 0, ScoreFunction::Sigmoid, false, ops::Activation::SquaredReLU, false}}) {
    MoeLayerConfig cfg = tiny_moe_config(c.E, c.K, c.shared, c.score, c.gate);
    cfg.activation = c.act;
    cfg.add_mlp_bias = c.bias;
    const int64_t n_tok = 7, H = cfg.hidden;
    ParamRegistry params(DType::F64);
    MoELayer<double> layer(cfg, params, "mlp");
    Arena arena;
    testing::plan_layer(arena, params, 17, [&](Arena& a) { layer.allocate(a, n_tok); });
    int n_bias = 0;
    for (const Param& prm : params.params()) {
      if (prm.name().ends_with("linear_fc1.bias") || prm.name().ends_with("linear_fc2.bias"))
        randomize(prm, 50 + n_bias++);
    }
    EXPECT_EQ(n_bias, c.bias ? (c.shared > 0 ? 4 : 2) : 0);
    auto x = random_vec<double>(n_tok * H, 21);
    auto R = random_vec<double>(n_tok * H, 22);
    std::vector<double> y(n_tok * H), dx(n_tok * H);
    auto loss = [&] {
      layer.forward(y.data(), x.data(), n_tok);
      return testing::weighted_sum(y.data(), R) + layer.router().aux_loss() +
             layer.router().z_loss();
    };
    SCOPED_TRACE(::testing::Message()
                 << "E=" << c.E << " K=" << c.K << " shared=" << c.shared << " gate=" << c.gate
                 << " " << ops::activation_name(c.act) << " bias=" << c.bias);
    EXPECT_TRUE(testing::check_layer_gradients(params, loss,
                                               [&] { layer.backward(dx.data(), R.data(), 1.0); },
                                               {{x.data(), dx.data(), n_tok * H, "dx"}}));
  }
}

// How far the last forward's routing is from changing: the smallest gap, over tokens, between
// the K-th and (K+1)-th largest logit (top-k selection; softmax and sigmoid are monotone in
// the logit), and over experts that overflow their capacity, between the probs of the last
// kept and the first dropped (token, slot) (the probs drop policy; position drops depend on
// the selection only). Probs before dropping are recomputed from the logits (softmax) or
// scores (sigmoid) of the selected experts.
struct RoutingMargins {
  double topk = INFINITY;
  double drop = INFINITY;
};

RoutingMargins routing_margins(const RouterSaved<double>& s, const RouterConfig& cfg) {
  const int64_t E = cfg.num_experts, K = cfg.topk, T = s.n_tok;
  RoutingMargins m;
  std::vector<double> pre(T * K);
  std::vector<std::vector<double>> cand(E);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> l(host(s.logits_TE) + t * E, host(s.logits_TE) + (t + 1) * E);
    std::sort(l.begin(), l.end(), std::greater<>());
    if (K < E) m.topk = std::min(m.topk, l[K - 1] - l[K]);
    double sum = 0, mx = -INFINITY;
    for (int64_t k = 0; k < K; ++k)
      mx = std::max(mx, host(s.logits_TE)[t * E + host(s.routed_TK)[t * K + k]]);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = host(s.routed_TK)[t * K + k];
      double v = cfg.score == ScoreFunction::Softmax ? std::exp(host(s.logits_TE)[t * E + e] - mx)
                                                     : host(s.scores_TE)[t * E + e];
      pre[t * K + k] = v;
      sum += v;
    }
    for (int64_t k = 0; k < K; ++k) {
      cand[host(s.routed_TK)[t * K + k]].push_back(pre[t * K + k] / sum * cfg.topk_scaling_factor);
    }
  }
  for (auto& c : cand) {
    if (static_cast<int64_t>(c.size()) <= s.capacity) continue;
    std::sort(c.begin(), c.end(), std::greater<>());
    m.drop = std::min(m.drop, c[s.capacity - 1] - c[s.capacity]);
  }
  return m;
}

// The whole layer with capacity dropping (both policies) and with padding to capacity, in
// fp64: dx and every parameter (router, fc1 and fc2 of every expert, the shared expert and its
// gate).
// Inputs in [0, 1) skew the load so some experts overflow and others (padding) get pad rows.
// A finite-difference step moves a logit or a prob by ~1e-5 * |x| or |W| (the expert and
// shared weights do not move them at all), so routing margins of kMargin = 1e-3, checked
// below, keep every top-k choice and every drop decision fixed under the perturbations.
TEST(MoELayer, FiniteDifferencesWithCapacityDroppingAndPadding) {
  constexpr double kMargin = 1e-3;
  struct Case {
    const char* name;
    TokenDropPolicy policy;
    bool pad;
    int64_t shared;
    ScoreFunction score;
    uint32_t seed;
    bool gate = false;  // --moe-shared-expert-gate
    bool gelu_bias = false;  // GeLU with MLP biases (pad rows: p = 0 keeps p b2 out of them)
  };
  for (Case c :
       {Case{"probs", TokenDropPolicy::Probs, false, 3, ScoreFunction::Softmax, 31},
        Case{"probs_pad", TokenDropPolicy::Probs, true, 0, ScoreFunction::Softmax, 31},
        Case{"position", TokenDropPolicy::Position, false, 0, ScoreFunction::Sigmoid, 31},
        Case{"position_pad", TokenDropPolicy::Position, true, 3, ScoreFunction::Softmax, 31},
        Case{"probs_gate", TokenDropPolicy::Probs, false, 3, ScoreFunction::Softmax, 31, true},
        Case{"probs_pad_gelu_bias", TokenDropPolicy::Probs, true, 3, ScoreFunction::Softmax, 31,
             false, true}}) {
    SCOPED_TRACE(c.name);
    MoeLayerConfig cfg = tiny_moe_config(4, 2, c.shared, c.score, c.gate);
    if (c.gelu_bias) {
      cfg.activation = ops::Activation::GeLU;
      cfg.add_mlp_bias = true;
    }
    cfg.moe.router.capacity_factor = 1.0;  // capacity = ceil(8 * 2 / 4 * 1.0) = 4
    cfg.moe.router.drop_policy = c.policy;
    cfg.moe.router.pad_to_capacity = c.pad;
    const int64_t n_tok = 8, H = cfg.hidden;
    ParamRegistry params(DType::F64);
    MoELayer<double> layer(cfg, params, "mlp");
    Arena arena;
    testing::plan_layer(arena, params, 17, [&](Arena& a) { layer.allocate(a, n_tok); });
    int n_bias = 0;
    for (const Param& prm : params.params()) {
      if (prm.name().ends_with(".bias")) randomize(prm, 60 + n_bias++);
    }
    EXPECT_EQ(n_bias, c.gelu_bias ? 4 : 0);
    auto x = random_vec<double>(n_tok * H, c.seed, 0.0, 1.0);
    auto R = random_vec<double>(n_tok * H, c.seed + 1);
    std::vector<double> y(n_tok * H), dx(n_tok * H);
    auto loss = [&] {
      layer.forward(y.data(), x.data(), n_tok);
      return testing::weighted_sum(y.data(), R) + layer.router().aux_loss() +
             layer.router().z_loss();
    };
    loss();
    const auto& rs = layer.router().saved();
    ASSERT_EQ(rs.capacity, 4);
    EXPECT_GT(layer.router().dropped(), 0) << "the case must really drop";
    if (c.pad) {
      EXPECT_EQ(layer.plan().rows_per_expert, rs.capacity);
      EXPECT_GT(*host(layer.plan().pad_rows), 0) << "the case must really pad";
    }
    RoutingMargins m = routing_margins(rs, cfg.moe.router);
    EXPECT_GT(m.topk, kMargin) << "a top-k choice is near a tie: pick another seed";
    if (c.policy == TokenDropPolicy::Probs) {
      EXPECT_GT(m.drop, kMargin) << "a drop decision is near a tie: pick another seed";
    }
    EXPECT_TRUE(testing::check_layer_gradients(params, loss,
                                               [&] { layer.backward(dx.data(), R.data(), 1.0); },
                                               {{x.data(), dx.data(), n_tok * H, "dx"}}));
  }
}

}  // namespace
}  // namespace moecore::moe
