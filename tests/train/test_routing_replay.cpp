// Routing replay through the trainer (train::TrainConfig::routing_replay, moe/routing_replay.h):
// a run that replays its own recording trains bitwise the same model, under every
// recomputation; another model's run routes every token as recorded; a store that cannot be
// replayed stops with its values named.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cli/train_flags.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "moe/routing_replay.h"
#include "train/trainer.h"

namespace moecore {

using testing::host;
namespace {

using moe::RoutingReplay;


// Three MoE layers and a dense one (cli::small_moe_train_flags), 2 micro-batches per step;
// "balancing": sigmoid scores with expert bias, group-limited routing and capacity dropping.
cli::TrainFlags replay_flags(const std::string& variant) {
  cli::TrainFlags f = cli::small_moe_train_flags();
  f.train.train_iters = 3;
  if (variant == "balancing") {
    f.router.score_function = "sigmoid";
    f.model.moe.router.enable_expert_bias = true;
    f.model.moe.router.num_groups = 2;
    f.model.moe.router.group_topk = 1;
    f.model.moe.router.capacity_factor = 1.0;
  }
  return f;
}

std::shared_ptr<RoutingReplay> new_store(const cli::TrainFlags& f) {
  return std::make_shared<RoutingReplay>(RoutingReplayMode::Record, f.train.global_batch,
                                         f.model.seq_length, f.model.moe.router.topk);
}

struct Result {
  std::vector<double> loss, aux, grad_norm;
  std::vector<char> weights;
  // The last step's last micro-batch: each MoE layer's chosen experts [T, K] (t = s * B + b).
  std::vector<std::vector<int32_t>> routed;
};

Result train(cli::TrainFlags f, const std::shared_ptr<RoutingReplay>& store,
             const std::string& recompute = "") {
  if (recompute == "moe") {
    f.recompute_granularity = "selective";
    f.model.recompute.module_names = {"moe"};
  } else if (recompute == "full") {
    f.recompute_granularity = "full";
    f.recompute_method = "uniform";
    f.model.recompute.num_layers = 1;
  }
  cli::finalize_train_flags(f);
  f.train.routing_replay = store;
  train::Trainer trainer(f.model, f.train);
  Result r;
  for (int64_t i = 0; i < f.train.train_iters; ++i) {
    const train::StepMetrics m = trainer.train_step();
    r.loss.push_back(m.lm_loss);
    r.aux.push_back(m.aux_loss);
    r.grad_norm.push_back(m.grad_norm);
  }
  const ParamRegistry& p = trainer.model().params();
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const char* w = static_cast<const char*>(host(p.flat_data(k)));
    r.weights.insert(r.weights.end(), w, w + p.numel(k) * sizeof(float));
  }
  for (const auto* router : trainer.model().routers()) {
    const auto& s = router->saved();
    const int32_t* idx = host(s.routed_TK);
    r.routed.emplace_back(idx, idx + s.n_tok * router->config().topk);
  }
  return r;
}

void expect_bitwise(const Result& a, const Result& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  EXPECT_EQ(a.aux, b.aux) << what;
  EXPECT_EQ(a.grad_norm, b.grad_norm) << what;
  ASSERT_EQ(a.weights.size(), b.weights.size());
  EXPECT_EQ(std::memcmp(a.weights.data(), b.weights.data(), a.weights.size()), 0)
      << what << ": the weights differ";
}

TEST(RoutingReplay, ReplayingItsOwnRecordingIsBitwiseUnderEveryRecomputation) {
  for (const std::string variant : {"softmax_jitter", "balancing"}) {
    const cli::TrainFlags f = replay_flags(variant);
    const Result plain = train(f, nullptr);
    const auto store = new_store(f);
    const Result recorded = train(f, store);
    expect_bitwise(plain, recorded, variant + " recording");
    EXPECT_EQ(store->tables(), 3u * 3u) << "3 iterations x 3 MoE layers";
    store->set_mode(RoutingReplayMode::Replay);
    for (const std::string recompute : {"", "moe", "full"}) {
      expect_bitwise(plain, train(f, store, recompute), variant + " replay " + recompute);
    }
  }
}

// The experts [T, K] of the last micro-batch's tokens (samples [G - B, G)) in the store's
// iteration-3 table of `layer`.
std::vector<int32_t> recorded_last_micro_batch(const RoutingReplay& r, const std::string& layer,
                                               int64_t B) {
  const std::vector<int32_t>& t = r.table(3, layer);
  const int64_t S = r.seq_length(), K = r.topk(), sample0 = r.samples() - B;
  std::vector<int32_t> out(S * B * K);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < K; ++k)
        out[(s * B + b) * K + k] = t[((sample0 + b) * S + s) * K + k];
  return out;
}

TEST(RoutingReplay, AnotherModelRoutesEveryTokenAsRecorded) {
  cli::TrainFlags f = replay_flags("balancing");
  const auto store = new_store(f);
  train(f, store);
  store->set_mode(RoutingReplayMode::Replay);
  f.train.seed = 77;  // other weights, other jitter
  const Result own = train(f, nullptr);
  const Result replayed = train(f, store);
  const std::vector<std::string> layers = {"decoder.layers.0.mlp", "decoder.layers.2.mlp",
                                           "decoder.layers.3.mlp"};
  ASSERT_EQ(replayed.routed.size(), layers.size());
  int differ = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::vector<int32_t> want =
        recorded_last_micro_batch(*store, layers[l], f.train.micro_batch);
    EXPECT_EQ(replayed.routed[l], want) << layers[l];
    differ += own.routed[l] != want ? 1 : 0;
  }
  EXPECT_GT(differ, 0) << "the other model routes otherwise by itself";
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(RoutingReplay, StoresThatCannotBeReplayedStopWithTheirValues) {
  cli::TrainFlags f = replay_flags("softmax_jitter");
  // Another global batch: before step 0.
  auto other = std::make_shared<RoutingReplay>(RoutingReplayMode::Replay, 8, 16, 2);
  expect_error([&] { train(f, other); }, "--global-batch-size 4");
  // Fewer iterations recorded than replayed.
  const auto store = new_store(f);
  f.train.train_iters = 2;
  train(f, store);
  store->set_mode(RoutingReplayMode::Replay);
  f.train.train_iters = 3;
  expect_error([&] { train(f, store); }, "nothing was recorded for iteration 3 at decoder.layers.0.mlp");
  // A token without a recorded expert.
  store->record_table(3, "decoder.layers.0.mlp");  // all -1
  expect_error([&] { train(f, store); }, "iteration 3 at decoder.layers.0.mlp: sample 0 position 0 has -1");
  // A dense model.
  f.model.num_experts = 0;
  expect_error([&] { train(f, store); }, "no MoE layers");
}

}  // namespace
}  // namespace moecore
