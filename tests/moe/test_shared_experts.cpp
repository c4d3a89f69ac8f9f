// The shared expert with --moe-shared-expert-gate: the gated branch and the whole MoE layer with
// it equal plain loops (outputs, input gradient, every weight gradient), fp64 finite
// differences of every input and parameter, the parameter Megatron names, and the validation
// of a gate without a shared expert.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/layer_testing.h"
#include "moe/moe_layer.h"
#include "moe/shared_experts.h"

namespace moecore::moe {

using testing::host;
namespace {

using testing::all_close;
using testing::random_vec;

MoeLayerConfig gated_config(int64_t E, int64_t K, int64_t shared) {
  MoeLayerConfig cfg;
  cfg.hidden = 6;
  cfg.num_experts = E;
  cfg.moe.router.num_experts = E;
  cfg.moe.router.topk = K;
  cfg.moe.router.aux_loss_coeff = 0.05;
  cfg.moe.router.z_loss_coeff = 0.01;
  cfg.moe.ffn_hidden = 4;
  cfg.moe.shared_ffn_hidden = shared;
  cfg.moe.shared_expert_gate = true;
  cfg.init_std = 0.4;
  cfg.output_init_std = 0.2;
  return cfg;
}

std::vector<double> values(const Param& p) {
  return std::vector<double>(host(p.data_as<double>()),
                             host(p.data_as<double>()) + p.local_numel());
}
std::vector<double> grads(const Param& p) {
  return std::vector<double>(host(p.grad_as<double>()),
                             host(p.grad_as<double>()) + p.local_numel());
}

double sigmoid(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}

// The gated shared expert in plain loops: s = SwiGLU MLP(x), g = sigmoid(x w_g^T),
// y = g s; and its backward for dy: dx, dfc1, dfc2, dw_g (all assigned).
struct GatedSharedRef {
  std::vector<double> y, dx, dfc1, dfc2, dgate;
};

GatedSharedRef gated_shared_ref(const std::vector<double>& x, const std::vector<double>& dy,
                                const std::vector<double>& fc1, const std::vector<double>& fc2,
                                const std::vector<double>& w, int64_t T, int64_t H, int64_t F) {
  GatedSharedRef r;
  r.y.assign(T * H, 0);
  r.dx.assign(T * H, 0);
  r.dfc1.assign(2 * F * H, 0);
  r.dfc2.assign(H * F, 0);
  r.dgate.assign(H, 0);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = &x[t * H];
    std::vector<double> h(2 * F, 0), a(F), s(H, 0), ds(H), da(F, 0), dh(2 * F);
    for (int64_t j = 0; j < 2 * F; ++j) {
      for (int64_t k = 0; k < H; ++k) h[j] += xt[k] * fc1[j * H + k];
    }
    for (int64_t f = 0; f < F; ++f) a[f] = h[f] * sigmoid(h[f]) * h[F + f];
    for (int64_t o = 0; o < H; ++o) {
      for (int64_t f = 0; f < F; ++f) s[o] += a[f] * fc2[o * F + f];
    }
    double l = 0;
    for (int64_t k = 0; k < H; ++k) l += xt[k] * w[k];
    const double g = sigmoid(l);
    for (int64_t o = 0; o < H; ++o) r.y[t * H + o] = g * s[o];
    // Backward.
    double dot = 0;
    for (int64_t o = 0; o < H; ++o) {
      ds[o] = g * dy[t * H + o];
      dot += dy[t * H + o] * s[o];
    }
    const double dl = g * (1 - g) * dot;
    for (int64_t k = 0; k < H; ++k) {
      r.dgate[k] += dl * xt[k];
      r.dx[t * H + k] += dl * w[k];
    }
    for (int64_t o = 0; o < H; ++o) {
      for (int64_t f = 0; f < F; ++f) {
        r.dfc2[o * F + f] += ds[o] * a[f];
        da[f] += ds[o] * fc2[o * F + f];
      }
    }
    for (int64_t f = 0; f < F; ++f) {
      const double gv = h[f], u = h[F + f], sg = sigmoid(gv);
      dh[f] = da[f] * u * sg * (1 + gv * (1 - sg));
      dh[F + f] = da[f] * gv * sg;
    }
    for (int64_t j = 0; j < 2 * F; ++j) {
      for (int64_t k = 0; k < H; ++k) {
        r.dfc1[j * H + k] += dh[j] * xt[k];
        r.dx[t * H + k] += dh[j] * fc1[j * H + k];
      }
    }
  }
  return r;
}

TEST(SharedExperts, GateWeightIsMegatronsParameter) {
  MoeLayerConfig cfg = gated_config(4, 2, 3);
  ParamRegistry params(DType::F64);
  SharedExperts<double> shared(cfg, params, "decoder.layers.2.mlp");
  EXPECT_TRUE(shared.gated());
  const Param* w = params.find("decoder.layers.2.mlp.shared_experts.gate_weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w, shared.gate_weight());
  EXPECT_EQ(w->spec.global_shape, (std::vector<int64_t>{1, cfg.hidden}));
  EXPECT_EQ(w->spec.kind, ParamKind::Dense);  // replicated over EP, reduced over DP
  EXPECT_EQ(w->spec.init, ParamInit::Normal);
  EXPECT_EQ(w->spec.init_std, cfg.init_std);  // Megatron's config.init_method
  EXPECT_TRUE(w->spec.weight_decay);
  // Registered after the MLP's weights, as Megatron's SharedExpertMLP does.
  EXPECT_EQ(params.params().back().name(), w->name());
  // Without the gate: no parameter, the ungated branch.
  cfg.moe.shared_expert_gate = false;
  ParamRegistry plain(DType::F64);
  SharedExperts<double> ungated(cfg, plain, "decoder.layers.2.mlp");
  EXPECT_FALSE(ungated.gated());
  EXPECT_EQ(plain.find("decoder.layers.2.mlp.shared_experts.gate_weight"), nullptr);
}

// The gated branch: y += sigmoid(x w_g^T) mlp(x) and dx += its input gradient, against plain
// loops on awkward token counts (1, 7), saturated and small gates both present.
TEST(SharedExperts, GatedEqualsPlainLoops) {
  const MoeLayerConfig cfg = gated_config(4, 2, 5);
  const int64_t H = cfg.hidden, F = cfg.moe.shared_ffn_hidden;
  for (int64_t T : {1, 7}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    ParamRegistry params(DType::F64);
    SharedExperts<double> shared(cfg, params, "mlp");
    Arena arena;
    testing::plan_layer(arena, params, 3, [&](Arena& a) { shared.allocate(a, 8, {}, false, false); });
    const auto x = random_vec<double>(T * H, 4, -2, 2);
    const auto y0 = random_vec<double>(T * H, 5);
    const auto dy = random_vec<double>(T * H, 6);
    const auto dx0 = random_vec<double>(T * H, 7);
    std::vector<double> y = y0, dx = dx0;
    shared.forward(y.data(), x.data(), x.data(), T);
    params.zero_grads();
    shared.backward(dx.data(), dy.data(), dy.data());
    const Param& fc1 = params.get("mlp.shared_experts.linear_fc1.weight");
    const Param& fc2 = params.get("mlp.shared_experts.linear_fc2.weight");
    const Param& w = *shared.gate_weight();
    const GatedSharedRef r = gated_shared_ref(x, dy, values(fc1), values(fc2), values(w), T, H, F);
    std::vector<double> y_want(T * H), dx_want(T * H);
    for (int64_t i = 0; i < T * H; ++i) {
      y_want[i] = y0[i] + r.y[i];     // the forward adds into y
      dx_want[i] = dx0[i] + r.dx[i];  // the backward adds into dx
    }
    EXPECT_TRUE(all_close(y, y_want, testing::kF64Rtol, testing::kF64Atol)) << "y";
    EXPECT_TRUE(all_close(dx, dx_want, testing::kF64Rtol, testing::kF64Atol)) << "dx";
    EXPECT_TRUE(all_close(grads(fc1), r.dfc1, testing::kF64Rtol, testing::kF64Atol)) << "dfc1";
    EXPECT_TRUE(all_close(grads(fc2), r.dfc2, testing::kF64Rtol, testing::kF64Atol)) << "dfc2";
    EXPECT_TRUE(all_close(grads(w), r.dgate, testing::kF64Rtol, testing::kF64Atol)) << "dgate";
  }
}

// fp64 central differences of the gated branch: dx and every parameter (fc1, fc2, gate_weight).
TEST(SharedExperts, GatedFiniteDifferences) {
  const MoeLayerConfig cfg = gated_config(4, 2, 3);
  const int64_t T = 7, H = cfg.hidden;
  ParamRegistry params(DType::F64);
  SharedExperts<double> shared(cfg, params, "mlp");
  Arena arena;
  testing::plan_layer(arena, params, 11, [&](Arena& a) { shared.allocate(a, T, {}, false, false); });
  auto x = random_vec<double>(T * H, 12);
  const auto R = random_vec<double>(T * H, 13);
  std::vector<double> y(T * H), dx(T * H);
  auto loss = [&] {
    std::fill(y.begin(), y.end(), 0.0);
    shared.forward(y.data(), x.data(), x.data(), T);
    return testing::weighted_sum(y.data(), R);
  };
  EXPECT_TRUE(testing::check_layer_gradients(params, loss,
                                             [&] {
                                               std::fill(dx.begin(), dx.end(), 0.0);
                                               shared.backward(dx.data(), R.data(), R.data());
                                             },
                                             {{x.data(), dx.data(), T * H, "dx"}}));
}

// The MoE layer with the gate = the same layer without a shared expert (its parameters have the
// same names, so the same values) plus the gated shared expert in plain loops: outputs, input
// gradient, the routed parameters' and the shared expert's gradients.
TEST(MoELayer, SharedExpertGateEqualsPlainLoopReference) {
  const MoeLayerConfig cfg = gated_config(5, 2, 4);
  MoeLayerConfig routed_cfg = cfg;
  routed_cfg.moe.shared_ffn_hidden = 0;
  routed_cfg.moe.shared_expert_gate = false;
  const int64_t T = 9, H = cfg.hidden, F = cfg.moe.shared_ffn_hidden;
  ParamRegistry pg(DType::F64), pr(DType::F64);
  MoELayer<double> gated(cfg, pg, "decoder.layers.0.mlp");
  MoELayer<double> routed(routed_cfg, pr, "decoder.layers.0.mlp");
  ASSERT_NE(gated.shared_experts(), nullptr);
  EXPECT_TRUE(gated.shared_experts()->gated());
  Arena ag, ar;
  testing::plan_layer(ag, pg, 21, [&](Arena& a) { gated.allocate(a, T); });
  testing::plan_layer(ar, pr, 21, [&](Arena& a) { routed.allocate(a, T); });
  const auto x = random_vec<double>(T * H, 22);
  const auto dy = random_vec<double>(T * H, 23);
  std::vector<double> yg(T * H), dxg(T * H), yr(T * H), dxr(T * H);
  pg.zero_grads();
  pr.zero_grads();
  gated.forward(yg.data(), x.data(), T);
  gated.backward(dxg.data(), dy.data(), 1.0);
  routed.forward(yr.data(), x.data(), T);
  routed.backward(dxr.data(), dy.data(), 1.0);
  const std::string p = "decoder.layers.0.mlp.shared_experts.";
  const GatedSharedRef r = gated_shared_ref(x, dy, values(pg.get(p + "linear_fc1.weight")),
                                            values(pg.get(p + "linear_fc2.weight")),
                                            values(pg.get(p + "gate_weight")), T, H, F);
  std::vector<double> y_want(T * H), dx_want(T * H);
  for (int64_t i = 0; i < T * H; ++i) {
    y_want[i] = yr[i] + r.y[i];
    dx_want[i] = dxr[i] + r.dx[i];
  }
  EXPECT_TRUE(all_close(yg, y_want, testing::kF64Rtol, testing::kF64Atol)) << "y";
  EXPECT_TRUE(all_close(dxg, dx_want, testing::kF64Rtol, testing::kF64Atol)) << "dx";
  for (const Param& q : pr.params()) {  // router and routed experts: the same gradients
    EXPECT_EQ(values(pg.get(q.name())), values(q)) << q.name() << " values";
    EXPECT_TRUE(all_close(grads(pg.get(q.name())), grads(q), testing::kF64Rtol, testing::kF64Atol))
        << q.name();
  }
  EXPECT_TRUE(all_close(grads(pg.get(p + "linear_fc1.weight")), r.dfc1, testing::kF64Rtol,
                        testing::kF64Atol));
  EXPECT_TRUE(all_close(grads(pg.get(p + "linear_fc2.weight")), r.dfc2, testing::kF64Rtol,
                        testing::kF64Atol));
  EXPECT_TRUE(
      all_close(grads(pg.get(p + "gate_weight")), r.dgate, testing::kF64Rtol, testing::kF64Atol));
}

// Selective recomputation of the gated layer ("moe" reruns the shared expert's forward in the
// backward, "shared_experts" recomputes its fc1 and activation): bitwise the layer without it.
TEST(MoELayer, SharedExpertGateRecomputationIsBitwise) {
  const MoeLayerConfig plain_cfg = gated_config(4, 2, 3);
  const int64_t T = 7, H = plain_cfg.hidden;
  const auto x = random_vec<double>(T * H, 31);
  const auto dy = random_vec<double>(T * H, 32);
  auto run = [&](const RecomputeModules& rm, std::vector<double>& y, std::vector<double>& dx,
                 std::vector<std::vector<double>>& g) {
    MoeLayerConfig cfg = plain_cfg;
    cfg.recompute = rm;
    ParamRegistry params(DType::F64);
    MoELayer<double> layer(cfg, params, "mlp");
    Arena arena;
    testing::plan_layer(arena, params, 33, [&](Arena& a) { layer.allocate(a, T); });
    y.assign(T * H, 0);
    dx.assign(T * H, 0);
    params.zero_grads();
    layer.forward(y.data(), x.data(), T);
    layer.backward(dx.data(), dy.data(), 1.0);
    g.clear();
    for (const Param& p : params.params()) g.push_back(grads(p));
  };
  std::vector<double> y0, dx0;
  std::vector<std::vector<double>> g0;
  run({}, y0, dx0, g0);
  RecomputeModules moe, shared, both;
  moe.moe = true;
  shared.shared_experts = true;
  both.moe = both.shared_experts = true;
  for (const auto& [rm, what] : {std::pair{moe, "moe"}, std::pair{shared, "shared_experts"},
                                 std::pair{both, "moe + shared_experts"}}) {
    SCOPED_TRACE(what);
    std::vector<double> y, dx;
    std::vector<std::vector<double>> g;
    run(rm, y, dx, g);
    EXPECT_EQ(y, y0);
    EXPECT_EQ(dx, dx0);
    EXPECT_EQ(g, g0);
  }
}

TEST(MoELayer, SharedExpertGateNeedsASharedExpert) {
  MoeLayerConfig cfg = gated_config(4, 2, 0);
  ParamRegistry params(DType::F64);
  const std::string msg = testing::error_of([&] { MoELayer<double> layer(cfg, params, "mlp"); });
  EXPECT_NE(msg.find("--moe-shared-expert-gate"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--moe-shared-expert-intermediate-size"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moecore::moe
