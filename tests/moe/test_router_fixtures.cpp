// Router vs Megatron-Core: every fixture under tests/fixtures/router (written by
// tools/make_router_fixtures.py from Megatron's own router functions) is replayed through the
// C++ router in three precisions: f64 model, f32 model with the fp32 gate, f32 model with
// --moe-router-dtype fp64. Selection, maps, capacity, counts must match exactly; every value and
// gradient is checked twice (docs/numerics.md, "Megatron router fixtures"): elementwise against
// the fp64 run of Megatron's functions ("expected_f64"), within the rounding that this variant's
// own arithmetic can add, and against Megatron as it runs ("expected", fp32 inside) within a few
// fp32 ulps of the tensor's largest value.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "common/paths.h"
#include "moe/router.h"

namespace moecore::moe {

using testing::host;
namespace {

using nlohmann::json;

using testing::kFixtureF64Ulps;
using testing::kMegatronFp32Ulps;
constexpr double kEps64 = 0x1p-52;  // ulp of 1 in f64
constexpr double kEps32 = 0x1p-23;  // ulp of 1 in f32
constexpr double kUnit32 = 0x1p-24;  // f32 unit roundoff: |fl(x) - x| <= kUnit32 |x|

std::string fixture_dir() { return ::moecore::testing::source_dir() + "/tests/fixtures/router"; }

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(fixture_dir(), ec)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

json load_fixture(const std::string& name) {
  std::ifstream in(fixture_dir() + "/" + name + ".json");
  EXPECT_TRUE(in.good()) << "missing fixture " << name;
  return json::parse(in);
}

LoadBalancing lb_type(const std::string& s) {
  if (s == "aux_loss") return LoadBalancing::AuxLoss;
  if (s == "seq_aux_loss") return LoadBalancing::SeqAuxLoss;
  if (s == "global_aux_loss") return LoadBalancing::GlobalAuxLoss;
  if (s == "sinkhorn") return LoadBalancing::Sinkhorn;
  if (s == "quantile_balancing") return LoadBalancing::QuantileBalancing;
  return LoadBalancing::None;
}

RouterConfig config_of(const json& c) {
  RouterConfig cfg;
  cfg.num_experts = c["E"];
  cfg.topk = c["K"];
  const std::string score = c["score"];
  cfg.score = score == "sigmoid"        ? ScoreFunction::Sigmoid
              : score == "sqrtsoftplus" ? ScoreFunction::SqrtSoftplus
                                        : ScoreFunction::Softmax;
  cfg.pre_softmax = c["pre_softmax"];
  cfg.topk_scaling_factor = c["scaling"].is_null() ? 1.0 : c["scaling"].get<double>();
  cfg.num_groups = c["num_groups"];
  cfg.group_topk = c["group_topk"];
  cfg.enable_expert_bias = !c["expert_bias"].is_null();
  cfg.bias_update_rate = c["bias_update_rate"];
  cfg.capacity_factor = c["capacity_factor"];
  cfg.drop_policy = c["drop_policy"] == "position" ? TokenDropPolicy::Position
                                                   : TokenDropPolicy::Probs;
  cfg.pad_to_capacity = c["pad"];
  cfg.z_loss_coeff = c["z_coeff"];
  cfg.megatron_aux_map = c["megatron_aux_map"];
  cfg.quantile_ema = c["quantile_ema"];
  const auto& lb = c["load_balancing"];
  cfg.load_balancing = lb_type(lb[0][0]);
  cfg.aux_loss_coeff = lb[0][1];
  for (size_t i = 1; i < lb.size(); ++i) cfg.extra_load_balancing.push_back({lb_type(lb[i][0]), lb[i][1]});
  return cfg;
}

enum class Variant { F64, F32Gate32, F32Gate64 };

struct FixtureParam {
  std::string fixture;
  Variant variant;
};

void PrintTo(const FixtureParam& p, std::ostream* os) { *os << p.fixture; }

std::vector<FixtureParam> all_params() {
  std::vector<FixtureParam> out;
  for (const auto& n : fixture_names()) {
    for (Variant v : {Variant::F64, Variant::F32Gate32, Variant::F32Gate64}) out.push_back({n, v});
  }
  return out;
}


std::vector<double> vec(const json& j, const char* key) { return j[key].get<std::vector<double>>(); }

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// |got_i - want_i| <= ulps * eps * max_j |want_j| + rtol * |want_i| + bound_i: a scale of the
// tensor's own largest value (what the arithmetic's rounding is relative to), a relative term
// for values rounded once to a narrower type, and optional per-element bounds (GEMM error).
// Reports the worst element and its share of the allowed error.
template <typename A>
::testing::AssertionResult within(const A* got, const std::vector<double>& want, double ulps,
                                  double eps, double rtol,
                                  const std::vector<double>* bound = nullptr) {
  const double atol = ulps * eps * max_abs(want);
  double worst = 0;
  size_t wi = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const double allowed = atol + rtol * std::abs(want[i]) + (bound ? (*bound)[i] : 0.0);
    const double share = err == 0 ? 0 : allowed > 0 ? err / allowed : INFINITY;
    if (!(share <= worst)) {
      worst = share;
      wi = i;
    }
  }
  if (worst <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "element " << wi << " of " << want.size() << ": " << static_cast<double>(got[wi])
         << " vs " << want[wi] << ", error " << std::abs(static_cast<double>(got[wi]) - want[wi])
         << " = " << worst << " x the allowed (" << ulps << " ulps of max |value| "
         << max_abs(want) << ", rtol " << rtol << ")";
}
template <typename A>
::testing::AssertionResult within(const std::vector<A>& got, const std::vector<double>& want,
                                  double ulps, double eps, double rtol,
                                  const std::vector<double>* bound = nullptr) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  }
  return within(got.data(), want, ulps, eps, rtol, bound);
}

// Error bound of an f32 GEMM element c_ij = sum_k a_ik b_kj of n terms, whatever the summation
// order (Higham, Accuracy and Stability, 3.1): gamma_n sum_k |a_ik| |b_kj|, gamma_n = n u / (1 - n u),
// plus one rounding of each a_ik (the f64 logit gradient rounded to f32 before the GEMM):
// (n + 1) u / (1 - (n + 1) u) sum_k |a_ik| |b_kj|. a [M, n], b [n, P] row-major (strides given).
std::vector<double> gemm_bound(const std::vector<double>& a, int64_t a_si, int64_t a_sk,
                               const std::vector<double>& b, int64_t b_sk, int64_t b_sj,
                               int64_t M, int64_t n, int64_t P) {
  const double g = (n + 1) * kUnit32 / (1 - (n + 1) * kUnit32);
  std::vector<double> out(M * P, 0.0);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < P; ++j) {
      double s = 0;
      for (int64_t k = 0; k < n; ++k) s += std::abs(a[i * a_si + k * a_sk]) * std::abs(b[k * b_sk + j * b_sj]);
      out[i * P + j] = g * s;
    }
  }
  return out;
}

template <typename T>
void replay(const json& c, bool gate64) {
  RouterConfig cfg = config_of(c);
  if (gate64) cfg.dtype = RouterDType::F64;
  const int64_t E = c["E"], K = c["K"], T_ = c["T"], H = c["H"], B = c["B"];
  const json& ex = c["expected"];
  ParamRegistry params(DTypeOf<T>::value);
  Router<T> router(cfg, H, 0.02, params, "decoder.layers.0.mlp");
  Arena arena;
  arena.plan([&](Arena& a) {
    params.allocate(a);
    router.allocate(a, T_);
  });
  std::vector<double> W = c["W"];
  T* w = host(params.get("decoder.layers.0.mlp.router.weight").template data_as<T>());
  for (int64_t i = 0; i < E * H; ++i) w[i] = static_cast<T>(W[i]);
  if (cfg.enable_expert_bias) {
    std::vector<double> b = c["expert_bias"];
    for (int64_t e = 0; e < E; ++e) host(router.expert_bias())[e] = static_cast<float>(b[e]);
  }
  if (!c["quantile_beta"].is_null()) {
    std::vector<double> b = c["quantile_beta"];
    for (int64_t e = 0; e < E; ++e) host(router.quantile_beta())[e] = static_cast<float>(b[e]);
  }
  router.set_training(c["training"].get<bool>());

  // Micro-batches of one step; the last one is compared.
  std::vector<std::vector<T>> xs;
  for (const auto& xj : c["x"]) {
    std::vector<double> xd = xj;
    xs.emplace_back(xd.begin(), xd.end());
  }
  for (const auto& x : xs) router.forward(x.data(), T_, T_ / B);
  const auto& s = router.saved();
  const json& wx = c["expected_f64"];

  // What this variant's own arithmetic adds to the fp64 values (docs/numerics.md):
  //  * logits: x and W_r are multiples of 2^-8 and H = 4, so the gate GEMM is exact in f32 too;
  //  * everything after the gate runs in f64 (scores, top-k, losses, the logit gradient):
  //    kFixtureF64Ulps f64 ulps of the tensor's largest value;
  //  * probs, and dx / dW through the f64 gate, are that f64 value rounded once to T: rtol u;
  //  * dx / dW through the f32 gate: an f32 GEMM of the rounded logit gradient, bounded per
  //    element by gemm_bound.
  constexpr bool f32 = std::is_same_v<T, float>;
  const double round_rtol = f32 ? kUnit32 : 0.0;
  // Against Megatron as it runs (fp32 inside): kMegatronFp32Ulps fp32 ulps of the largest value.
  auto megatron = [&](const auto* got, const char* key) {
    return within(got, vec(ex, key), kMegatronFp32Ulps, kEps32, 0.0);
  };

  EXPECT_TRUE(within(host(s.logits_TE), vec(wx, "logits"), 0, kEps64, 0.0)) << "logits (exact)";
  std::vector<int> routed(T_ * E, 0), kept(T_ * E, 0);
  std::vector<double> probs(T_ * E, 0.0);
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      routed[t * E + host(s.routed_TK)[t * K + k]] = 1;
      const int32_t e = host(s.idx_TK)[t * K + k];
      if (e >= 0) {
        kept[t * E + e] = 1;
        probs[t * E + e] = static_cast<double>(host(s.probs_TK)[t * K + k]);
      }
    }
  }
  EXPECT_EQ(routed, ex["routed_TE"].get<std::vector<int>>()) << "experts chosen";
  EXPECT_EQ(kept, ex["kept_TE"].get<std::vector<int>>()) << "experts kept after capacity";
  EXPECT_TRUE(within(probs, vec(wx, "probs_TE"), kFixtureF64Ulps, kEps64, round_rtol)) << "probs";
  EXPECT_TRUE(megatron(probs.data(), "probs_TE")) << "probs vs Megatron fp32";
  EXPECT_EQ(std::vector<int64_t>(host(s.tokens_per_expert_E), host(s.tokens_per_expert_E) + E),
            ex["tokens_per_expert"].get<std::vector<int64_t>>());
  EXPECT_EQ(s.capacity, ex["capacity"].get<int64_t>());
  EXPECT_EQ(router.dropped(), ex["dropped"].get<int64_t>());
  const RouterReport rep = router.report();
  const char* kNames[3] = {"aux_loss", "seq_aux_loss", "global_aux_loss"};
  for (int i = 0; i < 3; ++i) {
    if (!ex["aux"].contains(kNames[i])) continue;
    const std::vector<double> want = {wx["aux"][kNames[i]].get<double>()};
    EXPECT_TRUE(within(host(rep.lb_value + i), want, kFixtureF64Ulps, kEps64, 0.0)) << kNames[i];
    EXPECT_TRUE(within(host(rep.lb_value + i), {ex["aux"][kNames[i]].get<double>()},
                       kMegatronFp32Ulps, kEps32, 0.0))
        << kNames[i] << " vs Megatron fp32";
  }
  EXPECT_TRUE(within(host(rep.z_value), {wx["z"].get<double>()}, kFixtureF64Ulps, kEps64, 0.0))
      << "z";
  EXPECT_TRUE(within(host(rep.z_value), {ex["z"].get<double>()}, kMegatronFp32Ulps, kEps32, 0.0))
      << "z vs Megatron fp32";

  // The aux and z losses' part of the logit gradient alone (dprobs = 0): its entries are
  // 1e-4 .. 1e-8, far below the probs part, so it is checked at its own scale.
  std::vector<T> dx(T_ * H, T(0)), dprobs(T_ * K, T(0));
  params.zero_grads();
  router.backward(dx.data(), dprobs.data(), 1.0);
  EXPECT_TRUE(
      within(host(router.dlogits_TE()), vec(wx, "dlogits_lb"), kFixtureF64Ulps, kEps64, 0.0))
      << "dlogits of the aux and z losses";
  EXPECT_TRUE(megatron(host(router.dlogits_TE()), "dlogits_lb"))
      << "aux/z dlogits vs Megatron fp32";

  // Gradients of sum(probs * R) + sum coeff * aux + coeff_z * z at loss scale 1.
  std::vector<double> R = c["R"];
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t k = 0; k < K; ++k)
      dprobs[t * K + k] = static_cast<T>(R[t * E + host(s.routed_TK)[t * K + k]]);
  }
  std::fill(dx.begin(), dx.end(), T(0));
  params.zero_grads();
  router.backward(dx.data(), dprobs.data(), 1.0);
  const T* dW = host(params.get("decoder.layers.0.mlp.router.weight").template grad_as<T>());
  EXPECT_TRUE(within(host(router.dlogits_TE()), vec(wx, "dlogits"), kFixtureF64Ulps, kEps64, 0.0))
      << "dlogits";
  EXPECT_TRUE(megatron(host(router.dlogits_TE()), "dlogits")) << "dlogits vs Megatron fp32";
  std::vector<double> dx_bound, dw_bound;
  if (f32 && !gate64) {
    const std::vector<double> dl = vec(wx, "dlogits");
    const std::vector<double> x_last = c["x"].back().get<std::vector<double>>();
    dx_bound = gemm_bound(dl, E, 1, W, H, 1, T_, E, H);       // dx = dl [T, E] W [E, H]
    dw_bound = gemm_bound(dl, 1, E, x_last, H, 1, E, T_, H);  // dW = dl^T [E, T] x [T, H]
  }
  const auto* dxb = dx_bound.empty() ? nullptr : &dx_bound;
  const auto* dwb = dw_bound.empty() ? nullptr : &dw_bound;
  EXPECT_TRUE(within(dx.data(), vec(wx, "dx"), kFixtureF64Ulps, kEps64, round_rtol, dxb)) << "dx";
  EXPECT_TRUE(within(dW, vec(wx, "dW"), kFixtureF64Ulps, kEps64, round_rtol, dwb)) << "dW";
  EXPECT_TRUE(megatron(dx.data(), "dx")) << "dx vs Megatron fp32";
  EXPECT_TRUE(megatron(dW, "dW")) << "dW vs Megatron fp32";

  router.finish_step();
  if (ex.contains("bias_after")) {
    std::vector<double> want = ex["bias_after"];
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(host(router.expert_bias())[e], static_cast<float>(want[e])) << "expert bias " << e;
    }
  }
  if (wx.contains("beta_after")) {
    // An fp32 buffer: the f64 update rounded once.
    EXPECT_TRUE(within(host(router.quantile_beta()), vec(wx, "beta_after"), kFixtureF64Ulps, kEps64,
                       kUnit32))
        << "quantile beta";
  }
}

class RouterFixture : public ::testing::TestWithParam<FixtureParam> {};

TEST_P(RouterFixture, MatchesMegatron) {
  const FixtureParam p = GetParam();
  json c = load_fixture(p.fixture);
  if (c.contains("note") && !c["note"].get<std::string>().empty()) {
    RecordProperty("note", c["note"].get<std::string>());
  }
  switch (p.variant) {
    case Variant::F64: replay<double>(c, false); break;
    case Variant::F32Gate32: replay<float>(c, false); break;
    case Variant::F32Gate64: replay<float>(c, true); break;
  }
}

std::string fixture_test_name(const ::testing::TestParamInfo<FixtureParam>& info) {
  static const char* kVariant[] = {"f64", "f32", "f32_router_fp64"};
  return info.param.fixture + "_" + kVariant[static_cast<int>(info.param.variant)];
}

INSTANTIATE_TEST_SUITE_P(Megatron, RouterFixture, ::testing::ValuesIn(all_params()),
                         fixture_test_name);

// The fixture set must not silently vanish (a wrong source directory would skip them all).
TEST(RouterFixture, FixturesPresent) { EXPECT_GE(fixture_names().size(), 30u) << fixture_dir(); }

}  // namespace
}  // namespace moecore::moe
