// Routing replay in the router (Router::enable_routing_replay, moe/routing_replay.h): replaying
// the router's own selection is bitwise the selection; replayed experts set the probs (gathered
// from this router's scores), the counts and the losses; the backward is the gradient of the
// replayed routing (f64 finite differences); eval forwards select their own.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/layer_testing.h"
#include "moe/router.h"

namespace moecore::moe {
namespace {

using testing::host;
using testing::random_vec;

struct ReplayCase {
  const char* name;
  RouterConfig cfg;
};

RouterConfig router_cfg(int64_t E, int64_t K) {
  RouterConfig cfg;
  cfg.num_experts = E;
  cfg.topk = K;
  cfg.aux_loss_coeff = 0.1;
  cfg.z_loss_coeff = 0.01;
  return cfg;
}

std::vector<ReplayCase> replay_cases() {
  std::vector<ReplayCase> out;
  out.push_back({"softmax", router_cfg(6, 2)});
  RouterConfig pre = router_cfg(8, 2);
  pre.pre_softmax = true;
  pre.topk_scaling_factor = 2.5;
  out.push_back({"pre_softmax_scaled", pre});
  RouterConfig sig = router_cfg(8, 2);
  sig.score = ScoreFunction::Sigmoid;
  sig.enable_expert_bias = true;
  sig.num_groups = 4;
  sig.group_topk = 2;
  out.push_back({"sigmoid_bias_groups", sig});
  RouterConfig cap = router_cfg(4, 2);
  cap.capacity_factor = 0.5;
  out.push_back({"capacity_dropping", cap});
  return out;
}

// A router with its weights drawn from `seed` (the same for every instance), planned for n_tok.
struct TestRouter {
  ParamRegistry params{DType::F64};
  Router<double> router;
  Arena arena;
  TestRouter(const RouterConfig& cfg, int64_t H, int64_t n_tok, bool replay)
      : router(cfg, H, 0.5, params, "r") {
    if (replay) router.enable_routing_replay();
    testing::plan_layer(arena, params, 5, [&](Arena& a) { router.allocate(a, n_tok); });
  }
  void replay(const std::vector<int32_t>& idx) {
    std::copy(idx.begin(), idx.end(), host(router.replayed_experts()));
    router.set_routing_replayed(true);
  }
  std::vector<int32_t> routed(int64_t n) const {
    const int32_t* p = host(router.saved().routed_TK);
    return {p, p + n};
  }
};

TEST(RouterReplay, OwnSelectionIsBitwiseTheSelection) {
  const int64_t n_tok = 12, H = 5;
  for (const ReplayCase& c : replay_cases()) {
    SCOPED_TRACE(c.name);
    const int64_t K = c.cfg.topk;
    TestRouter a(c.cfg, H, n_tok, false), b(c.cfg, H, n_tok, true);
    if (c.cfg.enable_expert_bias) {  // a bias that moves the selection
      for (int64_t e = 0; e < c.cfg.num_experts; ++e) {
        host(a.router.expert_bias())[e] = 0.05f * static_cast<float>(e % 3);
        host(b.router.expert_bias())[e] = 0.05f * static_cast<float>(e % 3);
      }
    }
    const auto x = random_vec<double>(n_tok * H, 21);
    const auto R = random_vec<double>(n_tok * K, 22);
    a.router.forward(x.data(), n_tok);
    b.replay(a.routed(n_tok * K));
    b.router.forward(x.data(), n_tok);
    const auto& sa = a.router.saved();
    const auto& sb = b.router.saved();
    for (int64_t i = 0; i < n_tok * K; ++i) {
      EXPECT_EQ(host(sa.idx_TK)[i], host(sb.idx_TK)[i]) << i;
      EXPECT_EQ(host(sa.probs_TK)[i], host(sb.probs_TK)[i]) << i;
    }
    EXPECT_EQ(a.router.aux_loss(), b.router.aux_loss());
    EXPECT_EQ(a.router.z_loss(), b.router.z_loss());
    EXPECT_EQ(a.router.dropped(), b.router.dropped());
    std::vector<double> dxa(n_tok * H, 0.0), dxb(n_tok * H, 0.0);
    a.params.zero_grads();
    b.params.zero_grads();
    a.router.backward(dxa.data(), R.data(), 1.0);
    b.router.backward(dxb.data(), R.data(), 1.0);
    EXPECT_EQ(dxa, dxb);
    const double* ga = host(a.params.get("r.router.weight").grad_as<double>());
    const double* gb = host(b.params.get("r.router.weight").grad_as<double>());
    for (int64_t i = 0; i < c.cfg.num_experts * H; ++i) EXPECT_EQ(ga[i], gb[i]) << i;
  }
}

// Experts no selection would choose: token t gets (t + 1) % E, then (t + 3) % E, ... (distinct).
std::vector<int32_t> other_experts(int64_t n_tok, int64_t E, int64_t K) {
  std::vector<int32_t> idx(n_tok * K);
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t k = 0; k < K; ++k) idx[t * K + k] = static_cast<int32_t>((t + 1 + 2 * k) % E);
  return idx;
}

TEST(RouterReplay, ReplayedExpertsSetProbsAndCounts) {
  const int64_t n_tok = 10, H = 4, E = 6, K = 2;
  for (ScoreFunction score : {ScoreFunction::Softmax, ScoreFunction::Sigmoid}) {
    RouterConfig cfg = router_cfg(E, K);
    cfg.score = score;
    cfg.topk_scaling_factor = score == ScoreFunction::Sigmoid ? 2.5 : 1.0;
    TestRouter r(cfg, H, n_tok, true);
    const auto idx = other_experts(n_tok, E, K);
    r.replay(idx);
    const auto x = random_vec<double>(n_tok * H, 31);
    r.router.forward(x.data(), n_tok);
    const auto& s = r.router.saved();
    const double* logits = host(s.logits_TE);
    std::vector<int64_t> counts(E, 0);
    for (int64_t t = 0; t < n_tok; ++t) {
      // softmax over the replayed experts' logits (the top-k after softmax of Megatron's default),
      // or the sigmoid scores normalised over them, times the scaling factor.
      double w[2], sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double l = logits[t * E + idx[t * K + k]];
        w[k] = score == ScoreFunction::Softmax ? std::exp(l) : 1.0 / (1.0 + std::exp(-l));
        sum += w[k];
        ++counts[idx[t * K + k]];
      }
      for (int64_t k = 0; k < K; ++k) {
        EXPECT_EQ(host(s.routed_TK)[t * K + k], idx[t * K + k]);
        EXPECT_NEAR(host(s.probs_TK)[t * K + k], w[k] / sum * cfg.topk_scaling_factor, 1e-14)
            << t << " " << k;
      }
    }
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(host(s.tokens_per_expert_E)[e], counts[e]) << e;
  }
}

TEST(RouterReplay, BackwardIsTheReplayedRoutingsGradient) {
  const int64_t n_tok = 7, H = 5;
  for (const ReplayCase& c : replay_cases()) {
    if (c.cfg.capacity_factor > 0) continue;  // dropping moves with the probs: not smooth
    SCOPED_TRACE(c.name);
    const int64_t E = c.cfg.num_experts, K = c.cfg.topk;
    TestRouter r(c.cfg, H, n_tok, true);
    r.replay(other_experts(n_tok, E, K));
    auto x = random_vec<double>(n_tok * H, 41);
    const auto R = random_vec<double>(n_tok * K, 42);
    auto loss = [&] {
      r.router.forward(x.data(), n_tok);
      return testing::weighted_sum(host(r.router.saved().probs_TK), R) + r.router.aux_loss() +
             r.router.z_loss();
    };
    loss();
    std::vector<double> dx(n_tok * H, 0.0);
    r.params.zero_grads();
    r.router.backward(dx.data(), R.data(), 1.0);
    EXPECT_TRUE(testing::check_gradient(loss, x.data(), dx.data(), n_tok * H, "dx", 64));
    EXPECT_TRUE(testing::check_param_gradients(r.params, loss, 64));
  }
}

TEST(RouterReplay, EvalForwardsSelectTheirOwn) {
  const int64_t n_tok = 8, H = 4;
  const RouterConfig cfg = router_cfg(6, 2);
  TestRouter a(cfg, H, n_tok, false), b(cfg, H, n_tok, true);
  const auto x = random_vec<double>(n_tok * H, 51);
  a.router.set_training(false);
  b.router.set_training(false);
  a.router.forward(x.data(), n_tok);
  b.replay(other_experts(n_tok, 6, 2));
  b.router.forward(x.data(), n_tok);
  EXPECT_EQ(a.routed(n_tok * 2), b.routed(n_tok * 2));
}

TEST(RouterReplay, RefusedUnlessEnabledBeforeAllocation) {
  TestRouter r(router_cfg(4, 2), 3, 4, false);
  try {
    r.router.set_routing_replayed(true);
    FAIL() << "no replayed experts to route to";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not enabled"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore::moe
