// Router vs Megatron-Core: every fixture under tests/fixtures/router (written by
// tools/make_router_fixtures.py from Megatron's own router functions) is replayed through the
// C++ router in three precisions: f64 model, f32 model with the fp32 gate, f32 model with
// --moe-router-dtype fp64. Selection, maps, capacity, counts must match exactly; values and
// gradients within kMegatronRtol/kMegatronAtol.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "moe/router.h"

namespace moecore::moe {
namespace {

using nlohmann::json;

using testing::kMegatronAtol;
using testing::kMegatronRtol;

std::string fixture_dir() { return std::string(MOECORE_SOURCE_DIR) + "/tests/fixtures/router"; }

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
  T* w = params.get("decoder.layers.0.mlp.router.weight").template data_as<T>();
  for (int64_t i = 0; i < E * H; ++i) w[i] = static_cast<T>(W[i]);
  if (cfg.enable_expert_bias) {
    std::vector<double> b = c["expert_bias"];
    for (int64_t e = 0; e < E; ++e) router.expert_bias()[e] = static_cast<float>(b[e]);
  }
  if (!c["quantile_beta"].is_null()) {
    std::vector<double> b = c["quantile_beta"];
    for (int64_t e = 0; e < E; ++e) router.quantile_beta()[e] = static_cast<float>(b[e]);
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

  EXPECT_TRUE(testing::all_close(s.logits_TE, ex["logits"].get<std::vector<double>>().data(),
                                 T_ * E, kMegatronRtol, kMegatronAtol))
      << "logits";
  std::vector<int> routed(T_ * E, 0), kept(T_ * E, 0);
  std::vector<double> probs(T_ * E, 0.0);
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      routed[t * E + s.routed_TK[t * K + k]] = 1;
      const int32_t e = s.idx_TK[t * K + k];
      if (e >= 0) {
        kept[t * E + e] = 1;
        probs[t * E + e] = static_cast<double>(s.probs_TK[t * K + k]);
      }
    }
  }
  EXPECT_EQ(routed, ex["routed_TE"].get<std::vector<int>>()) << "experts chosen";
  EXPECT_EQ(kept, ex["kept_TE"].get<std::vector<int>>()) << "experts kept after capacity";
  EXPECT_TRUE(testing::all_close(probs, ex["probs_TE"].get<std::vector<double>>(), kMegatronRtol,
                        kMegatronAtol))
      << "probs";
  EXPECT_EQ(std::vector<int64_t>(s.tokens_per_expert_E, s.tokens_per_expert_E + E),
            ex["tokens_per_expert"].get<std::vector<int64_t>>());
  EXPECT_EQ(s.capacity, ex["capacity"].get<int64_t>());
  EXPECT_EQ(s.dropped, ex["dropped"].get<int64_t>());
  const char* kNames[3] = {"aux_loss", "seq_aux_loss", "global_aux_loss"};
  for (int i = 0; i < 3; ++i) {
    if (!ex["aux"].contains(kNames[i])) continue;
    const double want = ex["aux"][kNames[i]];
    EXPECT_NEAR(s.lb_value[i], want, kMegatronAtol + kMegatronRtol * std::abs(want)) << kNames[i];
  }
  EXPECT_NEAR(s.z_value, ex["z"].get<double>(), kMegatronAtol + kMegatronRtol * ex["z"].get<double>());

  // Gradients of sum(probs * R) + sum coeff * aux + coeff_z * z at loss scale 1.
  std::vector<double> R = c["R"];
  std::vector<T> dprobs(T_ * K);
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t k = 0; k < K; ++k) dprobs[t * K + k] = static_cast<T>(R[t * E + s.routed_TK[t * K + k]]);
  }
  std::vector<T> dx(T_ * H, T(0));
  params.zero_grads();
  router.backward(dx.data(), dprobs.data(), 1.0);
  EXPECT_TRUE(testing::all_close(router.dlogits_TE(), ex["dlogits"].get<std::vector<double>>().data(),
                                 T_ * E, kMegatronRtol, kMegatronAtol))
      << "dlogits";
  EXPECT_TRUE(testing::all_close(dx.data(), ex["dx"].get<std::vector<double>>().data(), T_ * H,
                                 kMegatronRtol, kMegatronAtol))
      << "dx";
  EXPECT_TRUE(testing::all_close(params.get("decoder.layers.0.mlp.router.weight").template grad_as<T>(),
                                 ex["dW"].get<std::vector<double>>().data(), E * H, kMegatronRtol,
                                 kMegatronAtol))
      << "dW";

  router.finish_step();
  if (ex.contains("bias_after")) {
    std::vector<double> want = ex["bias_after"];
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(router.expert_bias()[e], static_cast<float>(want[e])) << "expert bias " << e;
    }
  }
  if (ex.contains("beta_after")) {
    EXPECT_TRUE(testing::all_close(router.quantile_beta(),
                                   ex["beta_after"].get<std::vector<double>>().data(), E,
                                   kMegatronRtol, kMegatronAtol))
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

// The fixture set must not silently vanish (a wrong MOECORE_SOURCE_DIR would skip them all).
TEST(RouterFixture, FixturesPresent) { EXPECT_GE(fixture_names().size(), 30u) << fixture_dir(); }

}  // namespace
}  // namespace moecore::moe
