// Layout parity under mpirun: the same global model trained for 10 steps on the same global
// batch must give the 1-rank run's per-step lm loss, aux and z values and grad norm, and the same
// final weights (expert slices gathered over EP), within the "layout parity" rows of
// docs/numerics.md. The world size picks the layouts: data parallelism alone (EP 1, DP = world),
// and every EP in {2, 4, 8} dividing the world and the experts (expert-data-parallel size
// world / EP), with both dispatchers. Each rank also trains the 1-rank reference itself (tiny
// model), so nothing has to be shipped around. --overlap-grad-reduce must give bitwise the same
// run as the reduction after the backward, and replicas must stay bitwise equal: data-parallel
// ones, and under tensor parallelism every replicated parameter over its TP group. Further down:
// tensor, sequence and expert-tensor parallelism (--bf16 step by step), capacity dropping under
// TP, the distributed optimizer under TP.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <fmt/ranges.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/bf16_gemm_paths.h"
#include "common/mpi_testing.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "moe/routing_replay.h"
#include "ops/gemm_bf16.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore {

using testing::host;
namespace {

parallel::Runtime g_rt;

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b);
// Tiny (tiny_mpi_args: two MoE layers, 8 experts, top-2, shared expert), aux and z losses,
// clipping active, 10 steps.
const std::vector<std::string> kBase =
    cli::tiny_mpi_args() + std::vector<std::string>{"--train-iters", "10", "--lr-warmup-iters",
                                                    "2", "--moe-z-loss-coeff", "1e-3",
                                                    "--clip-grad", "0.5"};
// The aux loss on (a list option: given once per run).
const std::vector<std::string> kAux = {"--moe-aux-loss-coeff", "1e-2"};

// The flags exactly as `moecore train` parses them (so options of other branches, e.g. the
// dispatcher type, reach the configs the same way).
void parse_flags(cli::TrainFlags& f, std::vector<std::string> args) {
  CLI::App app;
  cli::add_train_flags(app, f);
  std::reverse(args.begin(), args.end());  // CLI11 takes them reversed
  app.parse(args);
  cli::finalize_train_flags(f);
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Run {
  std::vector<train::StepMetrics> metrics;
  std::map<std::string, std::vector<double>> weights;  // global tensors (expert slices gathered)
  std::vector<double> dense_flat, expert_flat;         // this rank's buffers, for replica checks
  std::vector<float> beta, bias;  // every MoE layer's quantile beta / expert bias, layer order
  int64_t launched_during_backward = 0;
  int64_t gathers_waited_in_forward = 0;  // --overlap-param-gather, over the run
  uint64_t digest = 0;                    // the trainer's weights digest
  size_t recomputed_bytes = 0;  // activations the plan recomputes instead of keeping
  size_t planned_bytes = 0;     // the model arena's block
  // linear_qkv's rows: per query group, q rows then k_rows key rows then v (ops/qkv_layout.h).
  int64_t qkv_group_rows = 0, q_rows = 0, k_rows = 0;
  int64_t num_experts = 0;  // the routed parameters' leading dimension (is_routed)
  // The optimizer's state bytes and this rank's owned elements per kind (dense, expert), and
  // the registry's element counts (--use-distributed-optimizer).
  int64_t state_bytes = 0;
  int64_t owned[2] = {0, 0}, numel[2] = {0, 0};
  // This rank's copy of every replicated parameter (TpRole Replicated and ReplicatedPartialGrad:
  // the same values on every rank of the kind's TP group), for the TP replica check.
  struct TpCopy {
    std::string name;
    ParamKind kind;
    std::vector<double> values;
  };
  std::vector<TpCopy> tp_copies;
  // RunOptions::first_update_weights: the global weights before step 1 and after the first
  // update.
  std::map<std::string, std::vector<double>> initial_weights, first_update_weights;
  int64_t buckets[2] = {0, 0};  // gradient buckets per kind (dense, expert)
  // Pipeline parallelism: the decoder layers this rank holds, the forwards its last step
  // recomputed before their backward.
  std::vector<int64_t> layers;
  int64_t replays = 0;
  // Dense parameters this rank holds whole on every TP rank (norms, the router, ...): none on a
  // loss stage holding only a tied table's copy.
  int64_t replicated_dense = 0;
};

template <typename T>
std::vector<double> to_double(const T* p, int64_t n) {
  return std::vector<double>(p, p + n);
}

// Set by MegatronModel: runs start from Megatron's default model with dropout 0.1
// (cli::megatron_model_train_flags) instead of the tiny model's flags.
bool g_megatron_model = false;
struct MegatronModel {
  MegatronModel() { g_megatron_model = true; }
  ~MegatronModel() { g_megatron_model = false; }
};
cli::TrainFlags base_flags() {
  return g_megatron_model ? cli::megatron_model_train_flags() : cli::tiny_train_flags();
}

// Parameter p's master values on this rank (its local elements): the registry's, or under
// --bf16 with the distributed optimizer the optimizer's pieces summed over the kind's group
// (every element owned by one rank of it; the others add exact zeros).
template <typename T>
std::vector<double> master_values(const train::BasicTrainer<T>& trainer, const Param& p,
                                  const parallel::ProcessGroups* groups) {
  if (p.data != nullptr) return to_double(host(p.data_as<T>()), p.local_numel());
  const optim::AdamWOptimizer& opt = p.spec.kind == ParamKind::Dense
                                         ? trainer.optimizer().dense()
                                         : trainer.optimizer().expert();
  std::vector<double> v(static_cast<size_t>(p.local_numel()), 0.0);
  const float* master = host(opt.owned_master());
  for (const optim::AdamWOptimizer::Piece& pc : opt.pieces()) {
    if (pc.p != &p) continue;
    for (int64_t i = 0; i < pc.count; ++i) v[pc.begin - p.offset + i] = master[pc.owned + i];
  }
  EXPECT_NE(groups, nullptr) << p.name();
  if (groups != nullptr) {
    groups->group(p.spec.kind == ParamKind::Dense ? parallel::GroupKind::DpCp
                                                  : parallel::GroupKind::ExptDp)
        .communicator()
        .all_reduce(v);
  }
  return v;
}

// The name and global size of every parameter some rank holds (pipeline stages hold different
// ones), the same list in the same order on every rank.
std::map<std::string, int64_t> world_param_names(const ParamRegistry& params,
                                                 const parallel::ProcessGroups& groups) {
  std::string mine;
  for (const Param& p : params.params()) mine += fmt::format("{} {}\n", p.name(), p.global_numel());
  std::vector<int32_t> chars(mine.begin(), mine.end());
  auto& world = groups.world().communicator();
  std::vector<int64_t> counts(static_cast<size_t>(world.size()), 0);
  std::vector<int64_t> n{static_cast<int64_t>(chars.size())};
  world.all_gather(n, counts);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  std::vector<int32_t> all(static_cast<size_t>(total));
  world.all_gather_v(chars, all, counts);
  std::map<std::string, int64_t> out;
  std::istringstream in(std::string(all.begin(), all.end()));
  std::string name;
  int64_t numel = 0;
  while (in >> name >> numel) out[name] = numel;
  return out;
}

// The global tensor of the parameter `name` (global_numel elements) from every rank's local
// values (p: this rank's, null where a pipeline stage does not hold it), whatever its slice (EP's
// experts, TP's rows or columns in parts, ETP inside an EP slice). The copies are compared
// before one is taken: each rank puts its values at their global indices (param_global_index),
// the largest and the smallest copy of every element are reduced over the world (max of v and
// of -v), and they must be equal: replicas (data-parallel, TP, ETP, the pipeline stages' tied
// tables) hold bitwise the same values, so a drift between copies fails here instead of being
// averaged away. Every element must be held by some rank.
std::vector<double> gather_global_by_name(const std::string& name, int64_t global_numel,
                                          const Param* p, const std::vector<double>& local,
                                          const parallel::ProcessGroups& groups) {
  const size_t n = static_cast<size_t>(global_numel);
  constexpr double kNone = -std::numeric_limits<double>::infinity();
  std::vector<double> hi(n, kNone), neg_lo(n, kNone), holders(n, 0.0);
  for (int64_t i = 0; p != nullptr && i < p->local_numel(); ++i) {
    const auto g = static_cast<size_t>(param_global_index(*p, i));
    hi[g] = std::max(hi[g], local[static_cast<size_t>(i)]);
    neg_lo[g] = std::max(neg_lo[g], -local[static_cast<size_t>(i)]);
    holders[g] += 1;
  }
  auto& world = groups.world().communicator();
  world.all_reduce(hi, parallel::ReduceOp::Max);
  world.all_reduce(neg_lo, parallel::ReduceOp::Max);
  world.all_reduce(holders);
  int64_t differing = 0;
  size_t first = 0;
  for (size_t g = 0; g < n; ++g) {
    EXPECT_GT(holders[g], 0) << name << " element " << g << " is held by no rank";
    if (hi[g] != -neg_lo[g] && differing++ == 0) first = g;
  }
  EXPECT_EQ(differing, 0) << name << ": " << differing << " elements differ between the ranks "
                          << "holding them, the first [" << first << "]: copies from "
                          << -neg_lo[first] << " to " << hi[first];
  return hi;
}

// The same for a parameter every rank holds a slice of.
std::vector<double> gather_global(const Param& p, const std::vector<double>& local,
                                  const parallel::ProcessGroups& groups) {
  return gather_global_by_name(p.name(), p.global_numel(), &p, local, groups);
}

// Every parameter's global tensor (expert and TP slices gathered, replicas compared:
// gather_global) from this rank's master values; tp_copies (if given) receives this rank's copy
// of every replicated parameter. Under pipeline parallelism every stage's parameters, copies of
// the tied table compared too.
template <typename T>
std::map<std::string, std::vector<double>> global_weights(
    train::BasicTrainer<T>& trainer, const parallel::ProcessGroups* groups,
    std::vector<Run::TpCopy>* tp_copies = nullptr) {
  std::map<std::string, std::vector<double>> out;
  if (groups != nullptr && groups->degrees().pp > 1) {
    const ParamRegistry& params = trainer.model().params();
    for (const auto& [name, numel] : world_param_names(params, *groups)) {
      const Param* p = params.find(name);
      std::vector<double> local;
      if (p != nullptr) {
        local = master_values(trainer, *p, groups);
        if (tp_copies != nullptr && p->spec.tp_role != TpRole::Sharded)
          tp_copies->push_back({p->name(), p->spec.kind, local});
      }
      out[name] = gather_global_by_name(name, numel, p, local, *groups);
    }
    return out;
  }
  for (const Param& p : trainer.model().params().params()) {
    std::vector<double> local = master_values(trainer, p, groups);
    if (tp_copies != nullptr && p.spec.tp_role != TpRole::Sharded) {
      tp_copies->push_back({p.name(), p.spec.kind, local});
    }
    if (p.local_numel() == p.global_numel()) {  // the whole tensor
      out[p.name()] = std::move(local);
      continue;
    }
    EXPECT_NE(groups, nullptr) << p.name() << " is sliced on one rank";
    if (groups == nullptr) continue;
    out[p.name()] = gather_global(p, local, *groups);
  }
  return out;
}

// What train_run records besides the defaults, and changes to the parsed flags.
struct RunOptions {
  // The global weights before the first step and after the first step that updates them
  // (learning rate > 0: step 2 with a warm-up from 0), Run::initial_weights and
  // first_update_weights. Not with --overlap-param-gather: that step's gathers would be pending.
  bool first_update_weights = false;
  std::function<void(cli::TrainFlags&)> edit;  // applied after parsing (fields without a flag)
};

// The options of a layout row's one-rank reference and of its layout run. Under --bf16 the
// layout replays the reference's routing (moe/routing_replay.h): the layouts sum attention's
// outputs in another order than one rank, so now and then a value lands on the other side of a
// bf16 rounding point, and a token within that of a top-k tie would go to another expert, a
// difference of routing, not of layout (docs/numerics.md, "The `--bf16` layout rows across
// seeds"). The f32 and f64 rows route by themselves.
struct ParityOptions {
  RunOptions ref, layout;
};
ParityOptions parity_options(bool bf16) {
  ParityOptions o;
  o.ref.first_update_weights = o.layout.first_update_weights = bf16;  // bf16: checked per step
  if (!bf16) return o;
  auto store = std::make_shared<std::shared_ptr<moe::RoutingReplay>>();
  o.ref.edit = [store](cli::TrainFlags& f) {
    const int64_t samples = f.train.global_batch > 0 ? f.train.global_batch : f.train.micro_batch;
    *store = std::make_shared<moe::RoutingReplay>(RoutingReplayMode::Record, samples,
                                                  f.model.seq_length, f.model.moe.router.topk);
    f.train.routing_replay = *store;
  };
  o.layout.edit = [store](cli::TrainFlags& f) {
    ASSERT_NE(*store, nullptr) << "the reference runs first";
    (*store)->set_mode(RoutingReplayMode::Replay);
    f.train.routing_replay = *store;
  };
  return o;
}

// Trains with `args`; groups null = the 1-rank reference.
template <typename T>
Run train_run(const std::vector<std::string>& args, const parallel::ProcessGroups* groups,
              const RunOptions& opt = {}) {
  cli::TrainFlags f = base_flags();
  parse_flags(f, args);
  if (opt.edit) opt.edit(f);
  train::BasicTrainer<T> trainer(f.model, f.train, groups);
  std::ostringstream log;
  Run r;
  if (opt.first_update_weights) {
    EXPECT_FALSE(f.train.ddp.overlap_param_gather) << "the first update's gathers are deferred";
    r.initial_weights = global_weights(trainer, groups);
    do {
      r.metrics.push_back(trainer.train_step());
    } while (r.metrics.back().lr == 0 && trainer.iteration() < f.train.train_iters);
    r.first_update_weights = global_weights(trainer, groups);
  }
  for (const train::StepMetrics& m : trainer.run(log)) r.metrics.push_back(m);
  r.launched_during_backward = trainer.grad_buckets().launched_during_backward();
  r.gathers_waited_in_forward = trainer.grad_buckets().waited_in_forward();
  r.digest = trainer.weights_digest();
  r.recomputed_bytes = trainer.model().arena().bytes_of(MemKind::Recomputed);
  r.planned_bytes = trainer.model().arena().planned_bytes();
  r.state_bytes = trainer.optimizer().state_bytes(MemKind::OptimizerState);
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const int i = static_cast<int>(k);
    r.owned[i] = trainer.grad_buckets().sharded() ? trainer.grad_buckets().owned_numel(k)
                                                  : trainer.model().params().numel(k);
    r.numel[i] = trainer.model().params().numel(k);
  }
  for (const auto& b : trainer.grad_buckets().buckets()) ++r.buckets[static_cast<int>(b.kind)];
  r.layers = trainer.model().layers();
  r.replays = trainer.pipeline_runner().replays();
  const ModelConfig& mc = f.model;
  r.k_rows = mc.head_dim();
  r.q_rows = mc.num_heads / mc.num_query_groups * mc.head_dim();
  r.qkv_group_rows = r.q_rows + 2 * r.k_rows;
  r.num_experts = mc.num_experts;
  const ParamRegistry& params = trainer.model().params();
  for (const Param& p : params.params())
    r.replicated_dense += p.spec.kind == ParamKind::Dense && p.spec.tp_role != TpRole::Sharded;
  r.weights = global_weights(trainer, groups, &r.tp_copies);
  const int64_t E = f.model.num_experts;
  for (const auto* router : trainer.model().routers()) {
    r.beta.insert(r.beta.end(), host(router->quantile_beta()), host(router->quantile_beta()) + E);
    r.bias.insert(r.bias.end(), host(router->expert_bias()), host(router->expert_bias()) + E);
  }
  // The flat buffers' master values, parameter by parameter in flat order.
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    std::vector<double>& flat = k == ParamKind::Dense ? r.dense_flat : r.expert_flat;
    flat.assign(static_cast<size_t>(params.numel(k)), 0.0);
    for (const Param& p : params.params()) {
      if (p.spec.kind != k) continue;
      const std::vector<double> v = master_values(trainer, p, groups);
      std::copy(v.begin(), v.end(), flat.begin() + p.offset);
    }
  }
  return r;
}

struct Diff {
  double lm = 0, aux = 0, z = 0, norm = 0, weights = 0;  // max relative differences
  double mtp = 0;  // over the MTP depths' losses (0 without MTP)
  double scaled = 0;  // the elementwise weight check's worst |w - w_ref| / its bound (<= 1)
};

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

struct Tol {
  double metric_rtol;  // per-step lm loss, aux, z, grad norm
  double weight_rtol, weight_atol;
  // --bf16: the routed parameters (is_routed) are held per expert to their travel
  // (expect_bf16_routed_weights_close) instead of element by element.
  bool routed_by_travel = false;
};

// The routed parameters: the experts' fc1 / fc2 weights and biases and the router's weight,
// global shape [E, ...] (expert-major). Their gradient for expert e sums over the tokens routed
// to e (the router's row e through the probs of the tokens whose top-k holds e), a set that a
// routing flip changes by a whole token; every other parameter's gradient sums over all the
// batch's tokens.
bool is_routed(const std::string& name) {
  const auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return name.find(".mlp.experts.linear_fc") != std::string::npos ||
         ends_with(".mlp.router.weight");
}

// Compares a layout's run with the reference: per-step values and every final weight.
Diff compare(const Run& got, const Run& ref, const Tol& tol, const std::string& what) {
  Diff d;
  EXPECT_EQ(got.metrics.size(), ref.metrics.size()) << what;
  for (size_t i = 0; i < std::min(got.metrics.size(), ref.metrics.size()); ++i) {
    const auto &g = got.metrics[i], &r = ref.metrics[i];
    d.lm = std::max(d.lm, rel(g.lm_loss, r.lm_loss));
    d.aux = std::max(d.aux, rel(g.aux_loss, r.aux_loss));
    d.z = std::max(d.z, rel(g.z_loss, r.z_loss));
    d.norm = std::max(d.norm, rel(g.grad_norm, r.grad_norm));
    EXPECT_LE(rel(g.lm_loss, r.lm_loss), tol.metric_rtol) << what << " lm loss, step " << i + 1;
    EXPECT_LE(rel(g.aux_loss, r.aux_loss), tol.metric_rtol) << what << " aux, step " << i + 1;
    EXPECT_LE(rel(g.z_loss, r.z_loss), tol.metric_rtol) << what << " z, step " << i + 1;
    EXPECT_LE(rel(g.grad_norm, r.grad_norm), tol.metric_rtol)
        << what << " grad norm, step " << i + 1;
    for (size_t k = 0; k < r.mtp_loss.size(); ++k) {
      d.mtp = std::max(d.mtp, rel(g.mtp_loss[k], r.mtp_loss[k]));
      EXPECT_LE(rel(g.mtp_loss[k], r.mtp_loss[k]), tol.metric_rtol)
          << what << " mtp_" << k + 1 << " loss, step " << i + 1;
    }
  }
  EXPECT_EQ(got.weights.size(), ref.weights.size()) << what;
  for (const auto& [name, want] : ref.weights) {
    auto it = got.weights.find(name);
    EXPECT_NE(it, got.weights.end()) << what << ": no " << name;
    if (it == got.weights.end()) continue;
    const std::vector<double>& have = it->second;
    EXPECT_EQ(have.size(), want.size()) << what << " " << name;
    if (have.size() != want.size()) continue;
    // The key bias does not change the loss (softmax is invariant to adding q . b_k to a whole
    // row of scores): its gradient is zero in exact arithmetic, rounding noise in practice, and
    // Adam turns noise into steps of up to ~lr of either sign. Its values are not determined by
    // the model, so they are held only to Adam's travel: twice 3.2 lr per step (|m^ / sqrt(v^)|
    // <= (1 - beta1) / sqrt(1 - beta2) for beta2 = 0.999, two runs).
    const bool qkv_bias = name.size() >= 15 && name.rfind("linear_qkv.bias") == name.size() - 15;
    double lr_travel = 0;
    for (const auto& m : ref.metrics) lr_travel += 2 * 3.2 * m.lr;
    auto is_key_bias = [&](size_t i) {
      if (!qkv_bias || ref.qkv_group_rows == 0) return false;
      const int64_t o = static_cast<int64_t>(i) % ref.qkv_group_rows;
      return o >= ref.q_rows && o < ref.q_rows + ref.k_rows;
    };
    double worst = 0;
    size_t worst_i = 0;
    const bool by_travel = tol.routed_by_travel && is_routed(name);
    for (size_t i = 0; i < want.size() && !by_travel; ++i) {
      const double err = std::abs(have[i] - want[i]);
      const double scaled = is_key_bias(i)
                                ? err / lr_travel
                                : err / (tol.weight_atol + tol.weight_rtol * std::abs(want[i]));
      if (scaled > worst) {
        worst = scaled;
        worst_i = i;
      }
      if (std::abs(want[i]) > 1e-3 && !is_key_bias(i))
        d.weights = std::max(d.weights, err / std::abs(want[i]));
    }
    if (by_travel) {  // held per expert (expect_bf16_routed_weights_close); reported here
      for (size_t i = 0; i < want.size(); ++i)
        if (std::abs(want[i]) > 1e-3)
          d.weights = std::max(d.weights, std::abs(have[i] - want[i]) / std::abs(want[i]));
      continue;
    }
    d.scaled = std::max(d.scaled, worst);
    EXPECT_LE(worst, 1.0) << what << " " << name << "[" << worst_i << "] = " << have[worst_i]
                          << ", 1 rank: " << want[worst_i];
  }
  return d;
}

void report(const std::string& what, const Diff& d) {
  if (g_rt.rank != 0) return;
  std::printf("[parity] %-52s max rel: lm %.2e  aux %.2e  z %.2e  grad norm %.2e  weights %.2e "
              "(%.2f of the row)%s\n",
              what.c_str(), d.lm, d.aux, d.z, d.norm, d.weights, d.scaled,
              d.mtp > 0 ? fmt::format("  mtp {:.2e}", d.mtp).c_str() : "");
  std::fflush(stdout);
}

// Bitwise: the same numbers, the same run.
void expect_bitwise(const Run& a, const Run& b, const std::string& what) {
  ASSERT_EQ(a.metrics.size(), b.metrics.size());
  for (size_t i = 0; i < a.metrics.size(); ++i) {
    EXPECT_EQ(a.metrics[i].lm_loss, b.metrics[i].lm_loss) << what << " step " << i + 1;
    EXPECT_EQ(a.metrics[i].grad_norm, b.metrics[i].grad_norm) << what << " step " << i + 1;
  }
  EXPECT_TRUE(a.dense_flat == b.dense_flat) << what << ": dense weights differ";
  EXPECT_TRUE(a.expert_flat == b.expert_flat) << what << ": expert weights differ";
  EXPECT_EQ(a.digest, b.digest) << what << ": weights digests differ";
}

// Replicas: dense weights equal on every rank of the dp_cp group, expert weights on every rank
// of the expt_dp group; and every replicated parameter (TpRole Replicated and
// ReplicatedPartialGrad) equal on every rank of its TP group (tp for dense parameters, expt_tp
// for expert ones), each parameter compared on its own, bitwise.
void expect_replicas_equal(const Run& r, const parallel::ProcessGroups& groups,
                           const std::string& what) {
  auto check = [&](const parallel::ProcessGroup& g, const std::vector<double>& v,
                   const std::string& kind) {
    std::vector<double> root = v;
    g.communicator().broadcast(root, 0);
    EXPECT_TRUE(root == v) << what << ": " << kind << " weights differ from rank 0 of '"
                           << g.name << "' (world rank " << g_rt.rank << ")";
  };
  check(groups.group(parallel::GroupKind::DpCp), r.dense_flat, "dense");
  check(groups.group(parallel::GroupKind::ExptDp), r.expert_flat, "expert");
  const parallel::ProcessGroup& tp = groups.group(parallel::GroupKind::Tp);
  const parallel::ProcessGroup& etp = groups.group(parallel::GroupKind::ExptTp);
  int compared = 0, compared_dense = 0;
  for (const Run::TpCopy& c : r.tp_copies) {
    const parallel::ProcessGroup& g = c.kind == ParamKind::Dense ? tp : etp;
    if (g.size() == 1) continue;
    check(g, c.values, "TP copy of " + c.name + ":");
    ++compared;
    compared_dense += c.kind == ParamKind::Dense;
  }
  // A stage with decoder or MTP layers or a final norm has replicated dense parameters (norms,
  // the router): under TP every one is compared, none compared would be a silent pass. (Expert
  // ones exist only with expert biases; a loss stage with a tied head holds only the table's
  // vocab-parallel copy.)
  if (tp.size() > 1) {
    EXPECT_EQ(compared_dense, r.replicated_dense) << what << ": replicated parameters compared";
    if (!r.layers.empty()) {
      EXPECT_GT(compared, 0) << what << ": no replicated parameter compared over tp";
    }
  }
}

parallel::ProcessGroups make_groups(parallel::ParallelConfig cfg,
                                    const std::vector<std::string>& args) {
  cli::TrainFlags f = base_flags();
  parse_flags(f, args);
  cfg.timeout_minutes = 1.0;  // a deadlock ends with a diagnostic, not a ctest timeout
  return parallel::init_process_groups(cfg, g_rt, cli::model_dims(f.model));
}

parallel::ProcessGroups make_groups(int ep, const std::vector<std::string>& args) {
  parallel::ParallelConfig cfg;
  cfg.ep = ep;
  return make_groups(cfg, args);
}

template <typename T>
Tol parity_tol() {
  if constexpr (std::is_same_v<T, double>) {
    return {testing::kParityF64Rtol, testing::kParityF64WeightRtol, testing::kParityF64WeightAtol};
  } else {
    return {testing::kParityF32Rtol, testing::kParityF32WeightRtol, testing::kParityF32WeightAtol};
  }
}

template <typename T>
const char* dtype_str() {
  return std::is_same_v<T, double> ? "f64" : "f32";
}

// EP = 1, DP = world: both reduction schedules against the 1-rank run, and against each other.
template <typename T>
void data_parallel_parity(const std::vector<std::string>& args, const std::string& name) {
  const Run ref = train_run<T>(args, nullptr);
  parallel::ProcessGroups groups = make_groups(1, args);
  const Run after = train_run<T>(args, &groups);
  const Run overlap = train_run<T>(args + std::vector<std::string>{"--overlap-grad-reduce"}, &groups);
  const std::string what = fmt::format("{} {} dp={} ep=1", name, dtype_str<T>(), g_rt.world_size);
  report(what, compare(after, ref, parity_tol<T>(), what));
  // Step 1: the same micro-batches on the same weights, losses summed in global order.
  EXPECT_EQ(after.metrics[0].lm_loss, ref.metrics[0].lm_loss) << what;
  EXPECT_EQ(after.metrics[0].aux_loss, ref.metrics[0].aux_loss) << what;
  expect_bitwise(overlap, after, what + " overlap vs after-backward");
  expect_replicas_equal(after, groups, what);
  if (g_rt.world_size > 1) {
    EXPECT_EQ(after.launched_during_backward, 0);
    EXPECT_GT(overlap.launched_during_backward, 0) << "nothing was overlapped";
  }
}

TEST(LayoutParity, DataParallelF64) { data_parallel_parity<double>(kBase + kAux, "base"); }
TEST(LayoutParity, DataParallelF32) { data_parallel_parity<float>(kBase + kAux, "base"); }

// Two micro-batches per rank where the world allows it, untied head, small buckets (several per
// layer: --ddp-bucket-size 300 elements), dense layer in between.
TEST(LayoutParity, DataParallelAccumulationAndSmallBuckets) {
  if (8 % (2 * g_rt.world_size) != 0) GTEST_SKIP() << "global batch 8 with micro-batch 2";
  const auto args = kBase + kAux + std::vector<std::string>{"--micro-batch-size", "2",
                                                     "--untie-embeddings-and-output-weights",
                                                     "--num-layers", "3", "--moe-layer-freq",
                                                     "[1,0,1]", "--ddp-bucket-size", "300"};
  data_parallel_parity<double>(args, "accumulation+buckets");
  data_parallel_parity<float>(args, "accumulation+buckets");
}

// EP > 1 (x expert data parallel world / EP), both dispatchers.
template <typename T>
void expert_parallel_parity(const std::vector<std::string>& args, const std::string& name) {
  const Run ref = train_run<T>(args, nullptr);
  int layouts = 0;
  for (int ep : {2, 4, 8}) {
    if (g_rt.world_size % ep != 0 || 8 % ep != 0) continue;
    parallel::ProcessGroups groups = make_groups(ep, args);
    for (const char* disp : {"allgather", "alltoall"}) {
      const auto a = args + std::vector<std::string>{"--moe-token-dispatcher-type", disp};
      const Run after = train_run<T>(a, &groups);
      const Run overlap = train_run<T>(a + std::vector<std::string>{"--overlap-grad-reduce"},
                                       &groups);
      const std::string what = fmt::format("{} {} ep={} edp={} {}", name, dtype_str<T>(), ep,
                                           g_rt.world_size / ep, disp);
      report(what, compare(after, ref, parity_tol<T>(), what));
      expect_bitwise(overlap, after, what + " overlap vs after-backward");
      expect_replicas_equal(after, groups, what);
      ++layouts;
    }
  }
  if (layouts == 0) GTEST_SKIP() << "no EP > 1 layout for world size " << g_rt.world_size;
}

TEST(LayoutParity, ExpertParallelF64) { expert_parallel_parity<double>(kBase + kAux, "base"); }
TEST(LayoutParity, ExpertParallelF32) { expert_parallel_parity<float>(kBase + kAux, "base"); }

// --use-distributed-optimizer (ZeRO-1): every layout the world allows (EP in {1, 2, 4}, the
// rest expert-data-parallel), with and without --overlap-grad-reduce, against the 1-rank run
// and against the same layout without sharding, both within the layout-parity tolerance (the
// norm's f64 sum of squares is associated per shard: not bitwise); overlap bitwise equal to
// the reduction after the backward, and --overlap-param-gather (the gathers deferred to the next
// forward) bitwise equal to both; replicas bitwise equal after the gather. The optimizer
// state is 8 bytes per owned element (each buffer aligned), and the owned elements of a group's ranks add up to the
// kind's elements: each once.
const std::vector<std::string> kDistOpt = {"--use-distributed-optimizer"};
const std::vector<std::string> kOverlap = {"--overlap-grad-reduce"};
const std::vector<std::string> kParamGather = {"--overlap-param-gather"};

void expect_state_is_sharded(const Run& r, const parallel::ProcessGroups* groups,
                             const std::string& what) {
  // m and v in fp32 per kind, each buffer rounded up to the arena's 64-byte alignment.
  auto buffer = [](int64_t n) { return (4 * n + 63) / 64 * 64; };
  EXPECT_EQ(r.state_bytes, 2 * (buffer(r.owned[0]) + buffer(r.owned[1]))) << what;
  EXPECT_LT(r.state_bytes - 8 * (r.owned[0] + r.owned[1]), 4 * 64) << what;
  std::vector<int64_t> owned = {r.owned[0], r.owned[1]};
  if (groups != nullptr) {
    std::vector<int64_t> dense = {owned[0]}, expert = {owned[1]};
    groups->group(parallel::GroupKind::DpCp).communicator().all_reduce(dense);
    groups->group(parallel::GroupKind::ExptDp).communicator().all_reduce(expert);
    owned = {dense[0], expert[0]};
  }
  EXPECT_EQ(owned[0], r.numel[0]) << what << ": dense elements owned over dp x cp";
  EXPECT_EQ(owned[1], r.numel[1]) << what << ": expert elements owned over expt_dp";
}

template <typename T>
void distributed_optimizer_parity(const std::vector<std::string>& args, const std::string& name) {
  const Run ref = train_run<T>(args, nullptr);
  const Run one = train_run<T>(args + kDistOpt, nullptr);  // DP 1, EDP 1: nothing sharded
  expect_bitwise(one, ref, name + " 1 rank: distributed optimizer vs not");
  expect_state_is_sharded(one, nullptr, name + " 1 rank");
  EXPECT_EQ(one.state_bytes, ref.state_bytes);
  for (int ep : {1, 2, 4}) {
    if (g_rt.world_size % ep != 0 || 8 % ep != 0) continue;
    parallel::ProcessGroups groups = make_groups(ep, args);
    const Run plain = train_run<T>(args, &groups);
    const Run dist = train_run<T>(args + kDistOpt, &groups);
    const Run overlap = train_run<T>(args + kDistOpt + kOverlap, &groups);
    const Run gather = train_run<T>(args + kDistOpt + kOverlap + kParamGather, &groups);
    const std::string what = fmt::format("{} {} dist-opt ep={} dp={} edp={}", name, dtype_str<T>(),
                                         ep, g_rt.world_size, g_rt.world_size / ep);
    report(what, compare(dist, ref, parity_tol<T>(), what));
    report(what + " vs plain", compare(dist, plain, parity_tol<T>(), what + " vs plain"));
    expect_bitwise(overlap, dist, what + " overlap vs after-backward");
    expect_bitwise(gather, overlap, what + " --overlap-param-gather vs not");
    expect_bitwise(gather, dist, what + " both overlaps vs none");
    expect_replicas_equal(dist, groups, what);
    expect_replicas_equal(gather, groups, what + " --overlap-param-gather");
    expect_state_is_sharded(dist, &groups, what);
    if (g_rt.world_size > 1) {
      EXPECT_LT(dist.state_bytes, plain.state_bytes) << what;
      EXPECT_GT(overlap.launched_during_backward, 0) << what;
    }
    // The forwards waited for the deferred gathers (nothing is deferred on one rank).
    EXPECT_EQ(gather.gathers_waited_in_forward > 0, g_rt.world_size > 1) << what;
    EXPECT_EQ(dist.gathers_waited_in_forward, 0) << what;
  }
}

// --bf16 (the compute copies follow each bucket's deferred gather): bitwise the run without
// --overlap-param-gather, with --overlap-grad-reduce alone and with neither, on every layout.
TEST(DistributedOptimizer, OverlapParamGatherBf16) {
  const auto args = kBase + kAux + std::vector<std::string>{"--bf16", "--train-iters", "4"};
  for (int ep : {1, 2}) {
    if (g_rt.world_size % ep != 0 || (ep > 1 && g_rt.world_size == ep)) continue;
    parallel::ProcessGroups groups = make_groups(ep, args);
    const auto dist = train_run<float>(args + kDistOpt, &groups);
    const auto overlap = train_run<float>(args + kDistOpt + kOverlap, &groups);
    const auto gather = train_run<float>(args + kDistOpt + kOverlap + kParamGather, &groups);
    const std::string what = fmt::format("bf16 dist-opt ep={} dp={} edp={}", ep,
                                         g_rt.world_size, g_rt.world_size / ep);
    expect_bitwise(gather, overlap, what + " --overlap-param-gather vs not");
    expect_bitwise(gather, dist, what + " both overlaps vs none");
    expect_replicas_equal(gather, groups, what);
  }
}

TEST(DistributedOptimizer, LayoutParityF32) {
  distributed_optimizer_parity<float>(kBase + kAux, "base");
}
TEST(DistributedOptimizer, LayoutParityF64) {
  distributed_optimizer_parity<double>(kBase + kAux, "base");
}
// Several buckets per layer (shard boundaries inside parameters) and micro-batch accumulation.
TEST(DistributedOptimizer, SmallBucketsF32) {
  distributed_optimizer_parity<float>(
      kBase + kAux + std::vector<std::string>{"--ddp-bucket-size", "300", "--num-layers", "3",
                                              "--moe-layer-freq", "[1,0,1]"},
      "buckets");
}

// Megatron's default model (GeLU, biases everywhere incl. the experts', LayerNorm, learned
// positions) with hidden and attention dropout 0.1: every element's mask follows its sample's
// place in the global batch, so each layout trains the one-rank model.
TEST(LayoutParity, MegatronDefaultModelWithDropoutDataParallel) {
  MegatronModel defaults;
  data_parallel_parity<float>(kBase + kAux, "megatron model + dropout");
}
TEST(LayoutParity, MegatronDefaultModelWithDropoutExpertParallel) {
  MegatronModel defaults;
  expert_parallel_parity<float>(kBase + kAux, "megatron model + dropout");
}

// Qwen-style options: the shared expert's gate and the attention output bias, dense parameters
// replicated over EP and reduced over DP like the router's; the bias starts at zero and moves.
const std::vector<std::string> kGateBias = {"--moe-shared-expert-gate",
                                            "--add-attention-output-bias"};

TEST(LayoutParity, SharedExpertGateAndOutputBiasDataParallel) {
  data_parallel_parity<double>(kBase + kAux + kGateBias, "gate+output bias");
}
TEST(LayoutParity, SharedExpertGateAndOutputBiasExpertParallelF64) {
  expert_parallel_parity<double>(kBase + kAux + kGateBias, "gate+output bias");
}
TEST(LayoutParity, SharedExpertGateAndOutputBiasExpertParallelF32) {
  expert_parallel_parity<float>(kBase + kAux + kGateBias, "gate+output bias");
}

// --moe-expert-rank-capacity-factor plans an EP rank's received rows for factor x its balanced
// load instead of the dropless worst case EP x T x K: a smaller plan, and (while no step routes
// more than that to a rank) bitwise the run planned for the worst case, both dispatchers, every
// EP of the world. The factors hold the tiny untrained router's 10 steps (one expert per rank at
// EP 8 is the most skewed: 1.75 is too small there) and stay below the worst case EP.
TEST(RankCapacity, BoundedDroplessIsBitwiseTheWorstCasePlan) {
  int layouts = 0;
  for (int ep : {2, 4, 8}) {
    if (g_rt.world_size % ep != 0 || 8 % ep != 0) continue;
    parallel::ProcessGroups groups = make_groups(ep, kBase + kAux);
    for (const char* disp : {"allgather", "alltoall"}) {
      const auto args =
          kBase + kAux + std::vector<std::string>{"--moe-token-dispatcher-type", disp};
      const std::string what = fmt::format("ep={} {}", ep, disp);
      const auto worst = train_run<float>(args, &groups);
      const auto bounded =
          train_run<float>(args + std::vector<std::string>{"--moe-expert-rank-capacity-factor",
                                                           ep == 8 ? "2.5" : "1.75"},
                           &groups);
      expect_bitwise(bounded, worst, what);
      EXPECT_LT(bounded.planned_bytes, worst.planned_bytes) << what;
      ++layouts;
    }
  }
  if (layouts == 0) GTEST_SKIP() << "no EP > 1 layout for world size " << g_rt.world_size;
}

// A step that routes more rows to an EP rank than the factor planned stops on every rank of the
// EP group at the count exchange, before any row moves, naming the rank, the rows, the ratio to
// the balanced load and the fix (EP = the world: one EP group, the alltoall dispatcher).
TEST(RankCapacity, OverTheBudgetStopsEveryEpRankNamingTheRows) {
  const int ep = g_rt.world_size;
  if (ep < 2 || 8 % ep != 0) GTEST_SKIP() << "EP = world size " << ep << " must divide 8 experts";
  const auto args = kBase + kAux +
                    std::vector<std::string>{"--moe-token-dispatcher-type", "alltoall",
                                             "--moe-expert-rank-capacity-factor", "1"};
  parallel::ProcessGroups groups = make_groups(ep, args);
  try {
    train_run<float>(args, &groups);
    ADD_FAILURE() << "a factor of 1 held every step of an untrained router";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* part : {"x the balanced load of 32 (T 16 x top-k 2)",
                             "over the 32 rows planned by --moe-expert-rank-capacity-factor 1",
                             "Resume from the last checkpoint with a factor of at least"}) {
      EXPECT_NE(m.find(part), std::string::npos) << m;
    }
  }
}

// Activation recomputation under expert parallelism reruns the dispatch's collectives in the
// backward (between the overlapped gradient all-reduces): in every --recompute-* mode (those of
// tests/train/test_recompute.cpp that fit two layers) and with both dispatchers, the model must
// be bitwise the one trained without it on the same layout. Several micro-batches per rank and
// input jitter; 3 steps (the world size 4 entry only: EP 2 x expert DP 2).
TEST(RecomputeParity, EveryModeExpertParallelBitwise) {
  if (g_rt.world_size % 2 != 0) GTEST_SKIP() << "EP = 2 needs an even world size";
  const auto base = kBase + kAux + std::vector<std::string>{
      "--moe-input-jitter-eps", "1e-2", "--overlap-grad-reduce", "--train-iters", "3"};
  parallel::ProcessGroups groups = make_groups(2, base);
  const std::vector<std::vector<std::string>> modes = {
      {"--recompute-granularity", "selective"},  // Megatron's default: core_attn
      {"--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe_act",
       "shared_experts"},
      {"--recompute-granularity", "selective", "--recompute-modules", "moe", "core_attn",
       "layernorm"},
      {"--recompute-granularity", "full", "--recompute-method", "uniform",
       "--recompute-num-layers", "1"},
      {"--recompute-granularity", "full", "--recompute-method", "uniform",
       "--recompute-num-layers", "2"},
      {"--recompute-granularity", "full", "--recompute-method", "block",
       "--recompute-num-layers", "1"},
      {"--recompute-granularity", "full", "--recompute-method", "block",
       "--recompute-num-layers", "2"}};
  for (const char* disp : {"alltoall", "allgather"}) {
    const auto args = base + std::vector<std::string>{"--moe-token-dispatcher-type", disp};
    const auto plain = train_run<float>(args, &groups);
    for (const auto& mode : modes) {
      std::string what = fmt::format("ep=2 {}", disp);
      for (size_t i = 1; i < mode.size(); i += 2) what += " " + mode[i];
      const auto got = train_run<float>(args + mode, &groups);
      EXPECT_EQ(plain.recomputed_bytes, 0u);
      EXPECT_GT(got.recomputed_bytes, 0u) << what << ": nothing recomputed";
      expect_bitwise(got, plain, what);
      EXPECT_TRUE(got.beta == plain.beta && got.bias == plain.bias) << what << ": router state";
    }
  }
}

// Dropout under recomputation: the attention core (its probabilities' masks), the norms, the
// experts' activation and whole layers rerun with the forward's counters, bitwise.
TEST(RecomputeParity, DropoutExpertParallelBitwise) {
  if (g_rt.world_size % 2 != 0) GTEST_SKIP() << "EP = 2 needs an even world size";
  MegatronModel defaults;
  const auto args = kBase + kAux + std::vector<std::string>{"--overlap-grad-reduce",
                                                             "--train-iters", "3"};
  parallel::ProcessGroups groups = make_groups(2, args);
  const auto plain = train_run<float>(args, &groups);
  for (const auto& mode : std::vector<std::vector<std::string>>{
           {"--recompute-granularity", "selective", "--recompute-modules", "core_attn",
            "layernorm", "moe_act"},
           {"--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"}}) {
    std::string what = "ep=2 dropout";
    for (size_t i = 1; i < mode.size(); i += 2) what += " " + mode[i];
    const auto got = train_run<float>(args + mode, &groups);
    EXPECT_GT(got.recomputed_bytes, 0u) << what << ": nothing recomputed";
    expect_bitwise(got, plain, what);
  }
}

// The gated shared expert under EP 2 with recomputation: "moe" reruns its forward (and the
// dispatch) in the backward, "shared_experts" keeps its output for the gate, full recomputation
// reruns the layers; bitwise the run without recomputation, both dispatchers, with --bf16 too.
TEST(RecomputeParity, SharedExpertGateExpertParallelBitwise) {
  if (g_rt.world_size % 2 != 0) GTEST_SKIP() << "EP = 2 needs an even world size";
  const auto base = kBase + kAux + kGateBias +
                    std::vector<std::string>{"--moe-input-jitter-eps", "1e-2",
                                             "--overlap-grad-reduce", "--train-iters", "3"};
  parallel::ProcessGroups groups = make_groups(2, base);
  const std::vector<std::vector<std::string>> modes = {
      {"--recompute-granularity", "selective", "--recompute-modules", "shared_experts"},
      {"--recompute-granularity", "selective", "--recompute-modules", "moe", "layernorm"},
      {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
       "1"}};
  for (const char* disp : {"alltoall", "allgather"}) {
    for (bool bf16 : {false, true}) {
      auto args = base + std::vector<std::string>{"--moe-token-dispatcher-type", disp};
      if (bf16) args.push_back("--bf16");
      const auto plain = train_run<float>(args, &groups);
      for (const auto& mode : modes) {
        std::string what = fmt::format("gate ep=2 {}{}", disp, bf16 ? " bf16" : "");
        for (size_t i = 1; i < mode.size(); i += 2) what += " " + mode[i];
        const auto got = train_run<float>(args + mode, &groups);
        EXPECT_GT(got.recomputed_bytes, 0u) << what << ": nothing recomputed";
        expect_bitwise(got, plain, what);
      }
    }
  }
}

// Aux-loss-free balancing: the expert bias moves from the token counts summed over TP x DP x CP
// (sigmoid router, no aux loss), quantile balancing from the beta estimates averaged over DP x CP.
// The routing after a few steps depends on them, so equal losses and weights mean equal buffers;
// the buffers are compared directly too.
template <typename T>
void balancing_parity(const std::vector<std::string>& args, const std::string& name, int ep) {
  const Run ref = train_run<T>(args, nullptr);
  parallel::ProcessGroups groups = make_groups(ep, args);
  const Run got = train_run<T>(args, &groups);
  const std::string what = fmt::format("{} {} dp={} ep={}", name, dtype_str<T>(),
                                       g_rt.world_size, ep);
  report(what, compare(got, ref, parity_tol<T>(), what));
}

const std::vector<std::string> kExpertBias = {
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "none",
    "--moe-aux-loss-coeff", "0"};
const std::vector<std::string> kQuantile = {
    "--moe-router-load-balancing-type", "quantile_balancing", "--moe-aux-loss-coeff", "0",
    "--moe-router-quantile-balancing-ema", "0.5"};

TEST(BalancingParity, ExpertBiasDataParallel) {
  balancing_parity<double>(kBase + kExpertBias, "expert bias", 1);
}
TEST(BalancingParity, QuantileDataParallel) {
  balancing_parity<double>(kBase + kQuantile, "quantile", 1);
}
// Quantile beta: every replica holds bitwise the same beta after each step (the estimates are
// averaged by one all-reduce over dp_cp, whose sum every rank receives), and it matches the
// 1-rank run within the parity tolerance (it is the mean of per-micro-batch order statistics,
// summed in another order). EP = 1 and, where the world allows, EP = 2 (dp_cp = the world).
TEST(BalancingParity, QuantileBetaEqualOnEveryReplica) {
  const auto args = kBase + kQuantile + std::vector<std::string>{"--train-iters", "3"};
  const ::moecore::Run ref = train_run<double>(args, nullptr);
  for (int ep : {1, 2}) {
    if (g_rt.world_size % ep != 0) continue;
    parallel::ProcessGroups groups = make_groups(ep, args);
    const ::moecore::Run got = train_run<double>(args, &groups);
    const std::string what = fmt::format("quantile dp={} ep={}", g_rt.world_size, ep);
    std::vector<float> root = got.beta;
    groups.group(parallel::GroupKind::DpCp).communicator().broadcast(root, 0);
    EXPECT_TRUE(root == got.beta) << what << ": beta differs from rank 0's (world rank "
                                  << g_rt.rank << ")";
    ASSERT_EQ(got.beta.size(), ref.beta.size());
    // beta is an fp32 buffer: kParityBetaUlps fp32 ulps of its largest |value|.
    double max_beta = 0, worst = 0;
    for (float b : ref.beta) max_beta = std::max(max_beta, std::abs(static_cast<double>(b)));
    const double atol = testing::kParityBetaUlps * 0x1p-23 * max_beta;
    for (size_t i = 0; i < ref.beta.size(); ++i) {
      const double err = std::abs(static_cast<double>(got.beta[i]) - ref.beta[i]);
      worst = std::max(worst, err);
      EXPECT_LE(err, atol) << what << " beta[" << i << "] = " << got.beta[i] << ", 1 rank "
                           << ref.beta[i];
    }
    EXPECT_GT(max_beta, 0.0) << "beta never moved";
    if (g_rt.rank == 0) {
      std::printf("[parity] %-52s beta: max |diff| %.2e = %.2f fp32 ulps of max |beta| %.3f\n",
                  what.c_str(), worst, worst / (0x1p-23 * max_beta), max_beta);
    }
  }
}

TEST(BalancingParity, ExpertBiasExpertParallel) {
  if (g_rt.world_size % 2 != 0) GTEST_SKIP();
  balancing_parity<double>(kBase + kExpertBias, "expert bias", 2);
}

// The expert-bias buffers themselves (their range per layer): after the same steps equal to the
// 1-rank run's, exactly (they move by +-rate from integer token counts).
TEST(BalancingParity, ExpertBiasBuffersEqualOneRank) {
  const auto args = kBase + kExpertBias;
  auto bias_of = [&](const parallel::ProcessGroups* groups) {
    cli::TrainFlags f = cli::tiny_train_flags();
    parse_flags(f, args);
    f.train.train_iters = 4;
    train::BasicTrainer<double> t(f.model, f.train, groups);
    std::ostringstream log;
    t.run(log);
    std::vector<float> all;
    model::MoeStats st = t.model().moe_stats();
    for (const auto& layer : st.layers) {
      all.push_back(layer.router.bias_min);
      all.push_back(layer.router.bias_max);
    }
    return all;
  };
  const std::vector<float> ref = bias_of(nullptr);
  parallel::ProcessGroups groups = make_groups(1, args);
  const std::vector<float> got = bias_of(&groups);
  EXPECT_EQ(got, ref);
  EXPECT_NE(ref[1], 0.0f) << "the expert bias never moved";
}

// MFU is per rank, as Megatron's TFLOP/s/GPU: the job's rate (the global batch's FLOPs) over
// the world's ranks x one rank's peak (--peak-tflops 0.1 here), in the step metrics, the logged
// interval and the summary alike.
TEST(LayoutParity, MfuDividesByEveryRanksPeak) {
  parallel::ProcessGroups groups = make_groups(1, kBase + kAux);
  cli::TrainFlags f = cli::tiny_train_flags();
  parse_flags(f, kBase + kAux);
  train::Trainer t(f.model, f.train, &groups);
  const train::StepMetrics m = t.train_step();
  EXPECT_EQ(t.job_peak_gflops(), 100.0 * g_rt.world_size);
  EXPECT_NEAR(m.mfu, m.tflops * 1e3 / (100.0 * g_rt.world_size), 1e-12);
}

// Bad layouts stop before training, on every rank, with the numbers in the message.
TEST(DataParallelValidation, GlobalBatchNotDivisibleByDp) {
  if (g_rt.world_size == 1) GTEST_SKIP();
  parallel::ProcessGroups groups = make_groups(1, kBase + kAux);
  const int w = g_rt.world_size;
  // micro 1: global batch w + 1 is not a multiple of dp = w.
  cli::TrainFlags f = cli::tiny_train_flags();
  parse_flags(f, kBase + std::vector<std::string>{"--global-batch-size", std::to_string(w + 1)});
  try {
    train::Trainer t(f.model, f.train, &groups);
    ADD_FAILURE() << "global batch " << w + 1 << " accepted with dp " << w;
  } catch (const Error& e) {
    const std::string want = fmt::format("--global-batch-size={} must be a multiple of "
                                         "--micro-batch-size=1 x data-parallel size {} = {}",
                                         w + 1, w, w);
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  // micro 2 x dp w does not divide a global batch of 2 w - 2... use 2 (w >= 2): 2 % (2 w) != 0.
  cli::TrainFlags g = cli::tiny_train_flags();
  parse_flags(g, kBase + std::vector<std::string>{"--micro-batch-size", "2", "--global-batch-size",
                                                  "2"});
  try {
    train::Trainer t(g.model, g.train, &groups);
    ADD_FAILURE() << "micro-batch 2 x dp " << w << " accepted for a global batch of 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("data-parallel size {} = {}", w, 2 * w)),
              std::string::npos)
        << e.what();
  }
}

// Tensor, sequence and expert-tensor parallelism, and Parallel Folding (attention and experts
// on their own grids over the same ranks), against the 1-rank run: every layout of the list the
// world size allows, with the model of the multi-rank tests given four heads (two query groups
// where TP <= 2) and a vocabulary padded to a multiple of 16 (so that TP 4 pads it as one rank
// does: Megatron pads to a multiple of divisible-by x TP, and padded rows are part of the
// softmax). The dropout layouts start from Megatron's default model (dropout 0.1 on the hidden
// states and the attention probabilities, LayerNorm, GeLU, biases, learned positions).
struct TpLayout {
  int tp = 1, etp = 0, ep = 1;
  bool sp = false;
  const char* dispatcher = "alltoall";
  bool megatron_model = false;  // dropout on
  bool distopt = false;         // --use-distributed-optimizer --overlap-grad-reduce beside
  int world = 0;                // the world size it runs at
  bool bf16 = false;            // --bf16 (f32 runs only), on both bf16 GEMM paths
  bool mla = false;             // multi-latent attention (kMla)
};

// Multi-latent attention in the model of the layouts above: q LoRA, the latents' norms
// (--qk-layernorm), YaRN with a ramp inside the rotated pairs and mscale != mscale_all_dim, v
// narrower than q / k (padded heads), linear_proj's bias.
const std::vector<std::string> kMla = {
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim",
    "6", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--rope-type",
    "yarn", "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "0.8",
    "--yarn-original-max-position-embeddings", "4", "--add-attention-output-bias"};

std::vector<std::string> tp_args(const TpLayout& l) {
  std::vector<std::string> a = {
      "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
      "--num-layers", "2", "--num-experts", "8", "--moe-ffn-hidden-size", "16",
      "--ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "16",
      "--vocab-size", "64", "--make-vocab-size-divisible-by", "16",
      "--micro-batch-size", "1", "--global-batch-size", "8",
      "--log-interval", "1000", "--peak-tflops", "0.1",
      "--train-iters", "10", "--lr-warmup-iters", "2", "--moe-z-loss-coeff", "1e-3",
      "--clip-grad", "0.5", "--moe-aux-loss-coeff", "1e-2",
      "--moe-token-dispatcher-type", l.dispatcher};
  if (l.tp <= 2) a = a + std::vector<std::string>{"--group-query-attention", "--num-query-groups", "2"};
  if (l.bf16) a.push_back("--bf16");
  if (l.mla) a = a + kMla;
  return a;
}

std::string tp_name(const TpLayout& l) {
  const int etp = l.etp > 0 ? l.etp : l.tp;
  return fmt::format("tp={}{} dp={} | ep={} etp={} edp={} {}{}{}", l.tp, l.sp ? " sp" : "",
                     l.world / l.tp, l.ep, etp, l.world / (l.ep * etp), l.dispatcher,
                     l.megatron_model ? " dropout" : "", l.bf16 ? " bf16" : "") +
         (l.mla ? " mla" : "");
}

const std::vector<TpLayout> kTpLayouts = {
    // 2 ranks
    {.tp = 2, .world = 2},
    {.tp = 2, .sp = true, .megatron_model = true, .world = 2},
    {.tp = 1, .etp = 2, .world = 2},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .dispatcher = "allgather", .world = 2},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .distopt = true, .world = 2},
    {.tp = 2, .world = 2, .bf16 = true},
    {.tp = 2, .sp = true, .world = 2, .bf16 = true},
    {.tp = 1, .etp = 2, .world = 2, .bf16 = true},
    // 4 ranks
    {.tp = 4, .world = 4},
    {.tp = 4, .sp = true, .world = 4},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .dispatcher = "allgather", .world = 4},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .megatron_model = true, .distopt = true, .world = 4},
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .world = 4},
    {.tp = 1, .etp = 2, .ep = 2, .dispatcher = "allgather", .world = 4},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .distopt = true, .world = 4, .bf16 = true},
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .megatron_model = true, .world = 4, .bf16 = true},
    // 8 ranks: the folded layouts of MOE_SEMANTICS
    {.tp = 2, .etp = 1, .ep = 4, .sp = true, .world = 8},
    {.tp = 2, .etp = 1, .ep = 8, .sp = true, .dispatcher = "allgather", .world = 8},
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .megatron_model = true, .distopt = true, .world = 8},
    {.tp = 4, .etp = 1, .ep = 8, .sp = true, .world = 8},
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .distopt = true, .world = 8, .bf16 = true},
};

// --moe-shared-expert-overlap (the shared expert computed while the alltoall dispatcher's
// all-to-alls are in flight): EP 2 x expert data parallel world / 2 with the tiny model's shared
// expert, dropless and padded to capacity, gated (with the attention output bias), gated under
// "moe" recomputation, and TP 2 + SP x EP 2 (the shared expert a TP region
// whose collectives run while the EP all-to-all is pending): 4 steps each, the per-step losses,
// grad norms and final weights bitwise those of the same layout without the flag, and both
// within the layout-parity row of the one-rank run (which has nothing in flight).
const std::vector<std::string> kSharedOverlap = {"--moe-shared-expert-overlap"};

template <typename T>
void shared_expert_overlap_parity(const std::vector<std::string>& args,
                                  const parallel::ParallelConfig& cfg, const std::string& name) {
  const Run ref = train_run<T>(args, nullptr);
  parallel::ProcessGroups groups = make_groups(cfg, args);
  const Run plain = train_run<T>(args, &groups);
  const Run overlap = train_run<T>(args + kSharedOverlap, &groups);
  const std::string what =
      fmt::format("shared overlap {} {} tp={}{} ep={} world={}", name, dtype_str<T>(), cfg.tp,
                  cfg.sequence_parallel ? " sp" : "", cfg.ep, g_rt.world_size);
  report(what + " off", compare(plain, ref, parity_tol<T>(), what + " off"));
  report(what + " on", compare(overlap, ref, parity_tol<T>(), what + " on"));
  expect_bitwise(overlap, plain, what + " on vs off");
  expect_replicas_equal(overlap, groups, what);
}

template <typename T>
void shared_expert_overlap_layouts() {
  const std::vector<std::string> steps = {"--train-iters", "4", "--moe-token-dispatcher-type",
                                          "alltoall"};
  const std::vector<std::string> padded = {"--moe-expert-capacity-factor", "1.5",
                                           "--moe-pad-expert-input-to-capacity"};
  parallel::ParallelConfig ep2;
  ep2.ep = 2;
  shared_expert_overlap_parity<T>(kBase + kAux + steps, ep2, "dropless");
  shared_expert_overlap_parity<T>(kBase + kAux + steps + padded, ep2, "padded");
  // The gated shared expert, also under "moe" recomputation (its forward rerun in the backward).
  shared_expert_overlap_parity<T>(kBase + kAux + steps + kGateBias, ep2, "gated");
  shared_expert_overlap_parity<T>(
      kBase + kAux + steps + kGateBias +
          std::vector<std::string>{"--recompute-granularity", "selective", "--recompute-modules",
                                   "moe"},
      ep2, "gated recompute moe");
  const TpLayout l{.tp = 2, .etp = 1, .ep = 2, .sp = true, .world = g_rt.world_size};
  parallel::ParallelConfig tp2;
  tp2.tp = 2;
  tp2.etp = 1;
  tp2.ep = 2;
  tp2.sequence_parallel = true;
  shared_expert_overlap_parity<T>(tp_args(l) + steps, tp2, "dropless");
}

TEST(SharedExpertOverlapParity, LayoutsF64) { shared_expert_overlap_layouts<double>(); }
TEST(SharedExpertOverlapParity, LayoutsF32) { shared_expert_overlap_layouts<float>(); }

// --bf16: step 1 runs on the same weights, so its loss and grad norm hold to the f32 row (the
// later steps' bf16 rounding flips compound: kParityBf16Rtol).
void expect_first_step_close(const Run& got, const Run& ref, const std::string& what) {
  ASSERT_FALSE(got.metrics.empty() || ref.metrics.empty()) << what;
  EXPECT_LE(rel(got.metrics[0].lm_loss, ref.metrics[0].lm_loss), testing::kParityF32Rtol)
      << what << " lm loss, step 1";
  EXPECT_LE(rel(got.metrics[0].grad_norm, ref.metrics[0].grad_norm), testing::kParityF32Rtol)
      << what << " grad norm, step 1";
}

// --bf16 under TP, step by step, in units of bf16's unit roundoff u = 2^-8 (8 significant bits;
// docs/numerics.md, "layout parity --bf16 under TP, per step"):
// - every step whose forward runs on the initial weights (step 1, and each step before the first
//   with a learning rate > 0: the warm-up starts at 0) holds to the f32 row, as step 1 does;
// - the weights after the first update (RunOptions::first_update_weights): per tensor, the norm
//   of their difference to the one-rank weights over the norm of that update (w_ref - w0) within
//   u. Both runs apply Adam's normalised step m^ / sqrt(v^) to gradients of the same weights that
//   differ only where an f32 ulp before a bf16 rounding point flipped a bf16 value (by one bf16
//   ulp, <= 2u relative, and only some inputs flip), so each tensor's update differs by a
//   fraction of u. The key part of linear_qkv.bias is left out (its gradient is rounding noise:
//   compare() holds it to Adam's travel);
// - every later step: lm loss within u/32, aux and z within u/8, grad norm within u. From the
//   first update on the bf16 flips compound step by step; these are the measured spread's upper
//   end with headroom (docs/numerics.md), 80x (lm) to 2.6x (grad norm) tighter than
//   kParityBf16Rtol, which stays the row of the final weights (bf16_parity_tol: the routed
//   parameters per expert, expect_bf16_routed_weights_close).
bool is_key_bias(const Run& ref, const std::string& name, size_t i) {
  const std::string suffix = "linear_qkv.bias";
  if (ref.qkv_group_rows == 0 || name.size() < suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const int64_t o = static_cast<int64_t>(i) % ref.qkv_group_rows;
  return o >= ref.q_rows && o < ref.q_rows + ref.k_rows;
}

void expect_bf16_steps_close(const Run& got, const Run& ref, const std::string& what) {
  constexpr double u = testing::kBf16UnitRoundoff;
  struct {
    double first_update = 0;             // the worst tensor's relative norm after the update
    double lm = 0, aux_z = 0, norm = 0;  // the worst later step
  } d;
  expect_first_step_close(got, ref, what);
  EXPECT_EQ(got.metrics.size(), ref.metrics.size()) << what;
  const size_t n = std::min(got.metrics.size(), ref.metrics.size());
  size_t first = 0;  // the first update's step (0-based)
  while (first + 1 < n && ref.metrics[first].lr == 0) ++first;
  for (size_t i = 0; i < n; ++i) {
    const auto &g = got.metrics[i], &r = ref.metrics[i];
    const std::string step = fmt::format(", step {}", i + 1);
    if (i <= first) {  // on the initial weights
      EXPECT_LE(rel(g.lm_loss, r.lm_loss), testing::kParityF32Rtol) << what << " lm loss" << step;
      EXPECT_LE(rel(g.aux_loss, r.aux_loss), testing::kParityF32Rtol) << what << " aux" << step;
      EXPECT_LE(rel(g.z_loss, r.z_loss), testing::kParityF32Rtol) << what << " z" << step;
      EXPECT_LE(rel(g.grad_norm, r.grad_norm), testing::kParityF32Rtol)
          << what << " grad norm" << step;
      continue;
    }
    d.lm = std::max(d.lm, rel(g.lm_loss, r.lm_loss));
    d.aux_z = std::max({d.aux_z, rel(g.aux_loss, r.aux_loss), rel(g.z_loss, r.z_loss)});
    d.norm = std::max(d.norm, rel(g.grad_norm, r.grad_norm));
    EXPECT_LE(rel(g.lm_loss, r.lm_loss), testing::kParityBf16StepLmRtol) << what << " lm" << step;
    EXPECT_LE(rel(g.aux_loss, r.aux_loss), testing::kParityBf16StepAuxZRtol)
        << what << " aux" << step;
    EXPECT_LE(rel(g.z_loss, r.z_loss), testing::kParityBf16StepAuxZRtol) << what << " z" << step;
    EXPECT_LE(rel(g.grad_norm, r.grad_norm), testing::kParityBf16StepGradNormRtol)
        << what << " grad norm" << step;
  }
  EXPECT_FALSE(ref.first_update_weights.empty()) << what << ": no weights after the first update";
  EXPECT_EQ(got.first_update_weights.size(), ref.first_update_weights.size()) << what;
  for (const auto& [name, want] : ref.first_update_weights) {
    const auto it = got.first_update_weights.find(name);
    const auto w0 = ref.initial_weights.find(name);
    EXPECT_NE(it, got.first_update_weights.end()) << what << ": no " << name;
    if (it == got.first_update_weights.end() || w0 == ref.initial_weights.end()) continue;
    const std::vector<double>& have = it->second;
    EXPECT_EQ(have.size(), want.size()) << what << " " << name;
    if (have.size() != want.size()) continue;
    // Adam's first step is lr g / (|g| + eps): an element that moved less than lr / 2 in both
    // runs had a gradient below eps in both, which no layout resolves (its sign is rounding
    // noise, and the noise sets the step: kParityBf16FirstUpdateRelNorm's note). Left out.
    const double half_lr = 0.5 * ref.metrics[first].lr;
    double diff = 0, update = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (is_key_bias(ref, name, i)) continue;
      const double step_want = want[i] - w0->second[i], step_have = have[i] - w0->second[i];
      if (std::abs(step_want) < half_lr && std::abs(step_have) < half_lr) {
        continue;
      }
      diff += (have[i] - want[i]) * (have[i] - want[i]);
      update += step_want * step_want;
    }
    const double relnorm = diff == 0 ? 0.0 : std::sqrt(diff / update);
    d.first_update = std::max(d.first_update, relnorm);
    EXPECT_LE(relnorm, testing::kParityBf16FirstUpdateRelNorm)
        << what << " " << name << " after the first update (step " << first + 1
        << "): |w - w_ref| / |w_ref - w0| = " << relnorm;
  }
  if (g_rt.rank == 0) {
    std::printf("[parity] %-52s first update %.2e u; later steps: lm %.2e u, aux/z %.2e u, "
                "grad norm %.2e u\n",
                what.c_str(), d.first_update / u, d.lm / u, d.aux_z / u, d.norm / u);
  }
}

// --bf16, the final weights of the routed parameters (is_routed), per expert e: the norm of
// their difference to the one-rank weights over the norm of the one-rank travel,
// |w_e - w_ref,e| / |w_ref,e - w0,e| <= kParityBf16RoutedTravelRelNorm. Element by element
// (compare()) they cannot be held to a learning rate: an element whose gradient terms nearly
// cancel takes its sign from the layouts' bf16 rounding flips (the layouts sum in another order,
// e.g. the CP ring's log-sum-exp merge), and Adam's normalised step turns it into a step of up
// to ~lr, kept by the momentum over the remaining steps (docs/numerics.md, "layout parity --bf16,
// final weights of the routed parameters"). The layout replays the reference's routing
// (parity_options), so no token changes experts. Over a whole expert those elements are a small
// part of its travel (measured <= 0.009); an error that moves one expert is not (its gradient
// doubled in one step: 0.072; negated: 0.32 .. 0.42).
void expect_bf16_routed_weights_close(const Run& got, const Run& ref, const std::string& what) {
  double worst = 0;
  std::string worst_at = "none";
  for (const auto& [name, want] : ref.weights) {
    if (!is_routed(name)) continue;
    const auto it = got.weights.find(name);
    const auto w0 = ref.initial_weights.find(name);
    ASSERT_NE(it, got.weights.end()) << what << ": no " << name;
    ASSERT_NE(w0, ref.initial_weights.end()) << what << ": no initial " << name;
    const std::vector<double>& have = it->second;
    ASSERT_EQ(have.size(), want.size()) << what << " " << name;
    ASSERT_GT(ref.num_experts, 0) << what;
    const size_t E = static_cast<size_t>(ref.num_experts), per = want.size() / E;
    ASSERT_EQ(per * E, want.size()) << what << " " << name << ": not [E, ...]";
    for (size_t e = 0; e < E; ++e) {
      double diff = 0, travel = 0;
      for (size_t i = e * per; i < (e + 1) * per; ++i) {
        diff += (have[i] - want[i]) * (have[i] - want[i]);
        travel += (want[i] - w0->second[i]) * (want[i] - w0->second[i]);
      }
      const double relnorm = diff == 0 ? 0.0 : std::sqrt(diff / travel);
      if (relnorm > worst) {
        worst = relnorm;
        worst_at = fmt::format("{} expert {}", name, e);
      }
      EXPECT_LE(relnorm, testing::kParityBf16RoutedTravelRelNorm)
          << what << " " << name << " expert " << e
          << ": |w - w_ref| / |w_ref - w0| = " << relnorm;
    }
  }
  if (g_rt.rank == 0) {
    std::printf("[parity] %-52s routed weights: |w - w_ref| / |w_ref - w0| <= %.3f (%s)\n",
                what.c_str(), worst, worst_at.c_str());
    std::fflush(stdout);
  }
}

// The final-weights rows of the --bf16 layout parity tests: the per-step rows
// (kParityBf16Rtol), the non-routed weights element by element, the routed ones per expert to
// their travel.
Tol bf16_parity_tol() {
  return Tol{testing::kParityBf16Rtol, testing::kParityBf16WeightRtol,
             testing::kParityBf16WeightAtol, /*routed_by_travel=*/true};
}

template <typename T>
void tensor_parallel_parity(bool bf16, const std::vector<TpLayout>& list = kTpLayouts) {
  int layouts = 0;
  for (const TpLayout& l : list) {
    if (l.world != g_rt.world_size || l.bf16 != bf16) continue;
    std::optional<MegatronModel> megatron;
    if (l.megatron_model) megatron.emplace();
    const std::vector<std::string> args = tp_args(l);
    const ParityOptions opt = parity_options(bf16);
    const Run ref = train_run<T>(args, nullptr, opt.ref);
    parallel::ParallelConfig cfg;
    cfg.tp = l.tp;
    cfg.etp = l.etp;
    cfg.ep = l.ep;
    cfg.sequence_parallel = l.sp;
    parallel::ProcessGroups groups = make_groups(cfg, args);
    const Run got = train_run<T>(args, &groups, opt.layout);
    const std::string what = fmt::format("{} {}", dtype_str<T>(), tp_name(l));
    const Tol tol = bf16 ? bf16_parity_tol() : parity_tol<T>();
    report(what, compare(got, ref, tol, what));
    if (bf16) expect_bf16_steps_close(got, ref, what);
    if (bf16) expect_bf16_routed_weights_close(got, ref, what);
    expect_replicas_equal(got, groups, what);
    if (l.distopt) {
      const Run dist = train_run<T>(args + kDistOpt + kOverlap, &groups, opt.layout);
      report(what + " dist-opt", compare(dist, ref, tol, what + " dist-opt"));
      if (bf16) expect_bf16_steps_close(dist, ref, what + " dist-opt");
      if (bf16) expect_bf16_routed_weights_close(dist, ref, what + " dist-opt");
      expect_replicas_equal(dist, groups, what + " dist-opt");
    }
    ++layouts;
  }
  if (layouts == 0) GTEST_SKIP() << "no tensor-parallel layout for world size " << g_rt.world_size;
}

TEST(TensorParallelParity, LayoutsF64) { tensor_parallel_parity<double>(false); }
TEST(TensorParallelParity, LayoutsF32) { tensor_parallel_parity<float>(false); }
// --bf16 (bf16 parameters, fp32 master weights): the vocab-parallel head's and the TP layers'
// bf16 GEMMs against the 1-rank --bf16 run, on the native bf16 GEMM path where the CPU has one
// and on the widened path.
TEST(TensorParallelParity, LayoutsBf16) {
  testing::for_each_bf16_gemm_path([](ops::Bf16GemmPath p) {
    SCOPED_TRACE(ops::bf16_gemm_path_name(p));
    tensor_parallel_parity<float>(true);
  });
}

// The allgather dispatcher with TP 2 x ETP 2 and in folded 8-rank layouts, and TP without SP
// with dropout on (the MoE layer routes the rank's sequence slice of the replicated hidden
// states, dropout masks follow the global positions), against one rank within the rows of the
// layouts above.
const std::vector<TpLayout> kTpLayoutsAllgatherAndDropout = {
    // 2 ranks
    {.tp = 2, .dispatcher = "allgather", .world = 2},  // TP 2 x ETP 2, no SP
    {.tp = 2, .megatron_model = true, .world = 2},      // TP 2, no SP, dropout
    // 4 ranks
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .dispatcher = "allgather", .world = 4},
    {.tp = 2, .megatron_model = true, .world = 4},  // TP 2 x DP 2, ETP 2 x EDP 2, no SP, dropout
    // 8 ranks: folded
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .dispatcher = "allgather", .megatron_model = true,
     .world = 8},
    {.tp = 4, .etp = 2, .ep = 4, .sp = true, .dispatcher = "allgather", .world = 8},
};

// Multi-latent attention (kMla) under TP 2 + SP (its latents gathered into the TP region, the up
// projections split over the heads), EP 4, and TP 2 + SP x EP 2 with the distributed optimizer
// (and --overlap-grad-reduce), against the one-rank MLA run within the f32 layout-parity rows;
// and under --bf16 at TP 2 + SP and TP 2 + SP x EP 2 within the --bf16 TP rows, step by step.
// Their own ctest entries (train_parity_mla_mpi_{2,4}): no layout at 8 ranks.
const std::vector<TpLayout> kMlaLayouts = {
    // 2 ranks
    {.tp = 2, .sp = true, .world = 2, .mla = true},
    {.tp = 2, .sp = true, .world = 2, .bf16 = true, .mla = true},
    // 4 ranks
    {.tp = 1, .ep = 4, .world = 4, .mla = true},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .distopt = true, .world = 4, .mla = true},
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .world = 4, .bf16 = true, .mla = true},
};

TEST(TensorParallelParity, MultiLatentAttentionF32) {
  tensor_parallel_parity<float>(false, kMlaLayouts);
}
TEST(TensorParallelParity, MultiLatentAttentionBf16) {
  testing::for_each_bf16_gemm_path([](ops::Bf16GemmPath p) {
    SCOPED_TRACE(ops::bf16_gemm_path_name(p));
    tensor_parallel_parity<float>(true, kMlaLayouts);
  });
}

TEST(TensorParallelParity, AllgatherAndDropoutLayoutsF64) {
  tensor_parallel_parity<double>(false, kTpLayoutsAllgatherAndDropout);
}
TEST(TensorParallelParity, AllgatherAndDropoutLayoutsF32) {
  tensor_parallel_parity<float>(false, kTpLayoutsAllgatherAndDropout);
}

parallel::ProcessGroups make_tp_groups(const TpLayout& l, const std::vector<std::string>& args) {
  parallel::ParallelConfig cfg;
  cfg.tp = l.tp;
  cfg.etp = l.etp;
  cfg.ep = l.ep;
  cfg.sequence_parallel = l.sp;
  return make_groups(cfg, args);
}

// Multi-latent attention's recomputation under TP 2 + SP x EP 2 (the world size 4 entry only):
// mla_up_proj (the latents gathered again, q, k, v recomputed), with core_attn and the norms, and
// full recomputation (the layer's latent gathers rerun), fp32 and --bf16: bitwise the run
// without recomputation on the same layout, 3 steps.
TEST(RecomputeParity, MultiLatentAttentionTensorParallelBitwise) {
  if (g_rt.world_size != 4) GTEST_SKIP() << "TP 2 x EP 2 needs 4 ranks";
  const TpLayout l{.tp = 2, .etp = 1, .ep = 2, .sp = true, .world = 4, .mla = true};
  const std::vector<std::vector<std::string>> modes = {
      {"--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"},
      {"--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "core_attn",
       "layernorm"},
      {"--recompute-granularity", "full", "--recompute-method", "uniform",
       "--recompute-num-layers", "1"}};
  for (bool bf16 : {false, true}) {
    auto args = tp_args(l) + std::vector<std::string>{"--train-iters", "3"};
    if (bf16) args.push_back("--bf16");
    parallel::ProcessGroups groups = make_tp_groups(l, args);
    const auto plain = train_run<float>(args, &groups);
    for (const auto& mode : modes) {
      std::string what = fmt::format("mla {}{}", tp_name(l), bf16 ? " bf16" : "");
      for (size_t i = 1; i < mode.size(); i += 2) what += " " + mode[i];
      const auto got = train_run<float>(args + mode, &groups);
      EXPECT_GT(got.recomputed_bytes, 0u) << what << ": nothing recomputed";
      expect_bitwise(got, plain, what);
    }
  }
}

// Capacity dropping under TP + SP and under ETP, with a capacity factor small enough that every
// run drops (asserted). Megatron computes the capacity on each rank from the tokens its router
// sees (apply_router_token_dropping: get_capacity(num_tokens * topk, E, cf) with num_tokens the
// router input's rows), before any dispatch: under attention TP that input is the rank's
// sequence slice, [r T / TP, (r + 1) T / TP) of the micro-batch's sequence-major tokens, so each
// TP rank keeps ceil(T / TP * K / E * cf) rows per expert of its own slice. The one-rank model
// of that is the one-rank run with TP capacity groups (RouterConfig::capacity_groups = TP: the
// same slices, each with its own capacity). ETP and EP change nothing there: the experts' ranks
// receive what the routing ranks kept (with TP 1 each rank routes its whole micro-batch, as one
// rank does: one group). Per step, the dropped (token, slot) pairs, summed over the layers, the
// micro-batches and the ranks, equal the reference's exactly; losses, grad norms and every
// weight within the f64 layout-parity rows; both drop policies.
struct CapacityLayout {
  TpLayout layout;
  const char* policy;  // --moe-token-drop-policy
};
const std::vector<CapacityLayout> kCapacityLayouts = {
    {{.tp = 2, .sp = true, .world = 2}, "probs"},                // TP 2 + SP, ETP 2
    {{.tp = 1, .etp = 2, .world = 2}, "position"},               // TP 1 x DP 2, ETP 2
    {{.tp = 2, .etp = 1, .ep = 2, .sp = true, .world = 4}, "position"},
    {{.tp = 2, .etp = 2, .ep = 2, .sp = true, .dispatcher = "allgather", .world = 4}, "probs"},
    {{.tp = 2, .etp = 2, .ep = 2, .sp = true, .world = 8}, "probs"},  // EDP 2
};

TEST(TensorParallelCapacity, EachTpRankDropsWithinItsSequenceSlice) {
  int layouts = 0;
  for (const CapacityLayout& c : kCapacityLayouts) {
    const TpLayout& l = c.layout;
    if (l.world != g_rt.world_size) continue;
    const auto args = tp_args(l) + std::vector<std::string>{"--moe-expert-capacity-factor", "1",
                                                            "--moe-token-drop-policy", c.policy};
    const int tp = l.tp;
    RunOptions groups_of_tp;
    groups_of_tp.edit = [tp](cli::TrainFlags& f) { f.model.moe.router.capacity_groups = tp; };
    const ::moecore::Run ref = train_run<double>(args, nullptr, groups_of_tp);
    parallel::ProcessGroups groups = make_tp_groups(l, args);
    const ::moecore::Run got = train_run<double>(args, &groups);
    const std::string what = fmt::format("f64 {} capacity 1 {}", tp_name(l), c.policy);
    report(what, compare(got, ref, parity_tol<double>(), what));
    expect_replicas_equal(got, groups, what);
    int64_t dropped = 0;
    ASSERT_EQ(got.metrics.size(), ref.metrics.size());
    for (size_t i = 0; i < got.metrics.size(); ++i) {
      EXPECT_EQ(got.metrics[i].dropped_tokens, ref.metrics[i].dropped_tokens)
          << what << " step " << i + 1;
      dropped += got.metrics[i].dropped_tokens;
    }
    EXPECT_GT(dropped, 0) << what << ": nothing dropped";
    if (g_rt.rank == 0) {
      std::printf("[parity] %-52s dropped %lld (token, slot) pairs in %zu steps\n", what.c_str(),
                  static_cast<long long>(dropped), got.metrics.size());
    }
    ++layouts;
  }
  if (layouts == 0) GTEST_SKIP() << "no capacity layout for world size " << g_rt.world_size;
}

// Bitwise but the logged grad norm, within a few f64 ulps: the distributed optimizer sums the
// squares of each rank's shard, then over the group (the same f64 sum, associated otherwise).
// The f32 model multiplies its gradients by the clip coefficient rounded to f32, where those ulps
// vanish, so losses, weights and digests stay bitwise.
void expect_bitwise_but_norm(const Run& a, const Run& b, const std::string& what) {
  ASSERT_EQ(a.metrics.size(), b.metrics.size());
  double worst = 0;
  for (size_t i = 0; i < a.metrics.size(); ++i) {
    EXPECT_EQ(a.metrics[i].lm_loss, b.metrics[i].lm_loss) << what << " step " << i + 1;
    EXPECT_EQ(a.metrics[i].aux_loss, b.metrics[i].aux_loss) << what << " step " << i + 1;
    EXPECT_LE(rel(a.metrics[i].grad_norm, b.metrics[i].grad_norm), testing::kF64FewUlps)
        << what << " grad norm, step " << i + 1;
    worst = std::max(worst, rel(a.metrics[i].grad_norm, b.metrics[i].grad_norm));
  }
  EXPECT_TRUE(a.dense_flat == b.dense_flat) << what << ": dense weights differ";
  EXPECT_TRUE(a.expert_flat == b.expert_flat) << what << ": expert weights differ";
  EXPECT_EQ(a.digest, b.digest) << what << ": weights digests differ";
  if (g_rt.rank == 0) {
    std::printf("[parity] %-52s bitwise; grad norm within %.1e\n", what.c_str(), worst);
  }
}

// The distributed optimizer under tensor parallelism: TP 2 x DP 2 with ETP 2 x EDP 2 and with
// EP 2 x EDP 2 (ETP 1), and TP 2 x DP 4 with ETP 2 x EP 2 x EDP 2 (8 ranks); at TP 2 on 2 ranks
// (DP = EDP = 1) nothing may be sharded. The optimizer state is sharded: each rank's Adam
// moments hold exactly its owned elements (expect_state_is_sharded), which add up over the
// group to the kind's elements, and each rank owns about 1/d of them: every bucket of n elements
// gives a rank ceil(n / d) of them, or what is left at the end, so the owned count lies in
// [numel / d - buckets (d - 1), numel / d + buckets]. --overlap-param-gather (with
// --overlap-grad-reduce) is bitwise the distributed optimizer without it, and that bitwise the
// same layout without the distributed optimizer but for the logged grad norm
// (expect_bitwise_but_norm): the reduce-scatter gives each element the all-reduce's sum, the
// gather moves the updated values unchanged.
const std::vector<TpLayout> kTpDistOptLayouts = {
    {.tp = 2, .world = 2},                                  // DP 1, EDP 1: nothing sharded
    {.tp = 2, .world = 4},                                  // DP 2; ETP 2 x EDP 2
    {.tp = 2, .etp = 1, .ep = 2, .sp = true, .world = 4},  // DP 2; EP 2 x EDP 2
    {.tp = 2, .etp = 2, .ep = 2, .sp = true, .world = 8},  // DP 4; ETP 2 x EP 2 x EDP 2
};

void expect_owned_about_one_dth(const Run& r, const parallel::ProcessGroups& groups,
                                const std::string& what) {
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const int i = static_cast<int>(k);
    const int64_t d = groups.group(k == ParamKind::Dense ? parallel::GroupKind::DpCp
                                                         : parallel::GroupKind::ExptDp)
                          .size();
    const char* kind = k == ParamKind::Dense ? "dense" : "expert";
    if (d == 1) {
      EXPECT_EQ(r.owned[i], r.numel[i]) << what << ": " << kind << " sharded over one rank";
      continue;
    }
    EXPECT_GE(r.owned[i] + r.buckets[i] * (d - 1), r.numel[i] / d) << what << " " << kind;
    EXPECT_LE(r.owned[i], r.numel[i] / d + r.buckets[i]) << what << " " << kind;
    EXPECT_LT(r.owned[i], r.numel[i]) << what << ": " << kind << " state not sharded";
  }
}

TEST(DistributedOptimizer, TensorParallelShardsTheStateAndGathersBitwise) {
  int layouts = 0;
  for (const TpLayout& l : kTpDistOptLayouts) {
    if (l.world != g_rt.world_size) continue;
    const auto args = tp_args(l);
    parallel::ProcessGroups groups = make_tp_groups(l, args);
    const ::moecore::Run plain = train_run<float>(args, &groups);
    const ::moecore::Run dist = train_run<float>(args + kDistOpt, &groups);
    const ::moecore::Run gather =
        train_run<float>(args + kDistOpt + kOverlap + kParamGather, &groups);
    const std::string what = fmt::format("f32 {} dist-opt", tp_name(l));
    const bool sharded = groups.dp_cp().size() > 1 || groups.expt_dp().size() > 1;
    expect_state_is_sharded(dist, &groups, what);
    expect_state_is_sharded(gather, &groups, what + " --overlap-param-gather");
    expect_owned_about_one_dth(dist, groups, what);
    if (sharded) {
      EXPECT_LT(dist.state_bytes, plain.state_bytes) << what;
    } else {
      EXPECT_EQ(dist.state_bytes, plain.state_bytes) << what;
    }
    expect_bitwise(gather, dist, what + " --overlap-param-gather vs not");
    expect_bitwise_but_norm(dist, plain, what + " vs without the distributed optimizer");
    expect_replicas_equal(gather, groups, what + " --overlap-param-gather");
    EXPECT_EQ(gather.gathers_waited_in_forward > 0, sharded) << what;
    if (g_rt.rank == 0) {
      std::printf("[parity] %-52s owned dense %lld of %lld, expert %lld of %lld\n", what.c_str(),
                  static_cast<long long>(dist.owned[0]), static_cast<long long>(dist.numel[0]),
                  static_cast<long long>(dist.owned[1]), static_cast<long long>(dist.numel[1]));
    }
    ++layouts;
  }
  if (layouts == 0) GTEST_SKIP() << "no TP layout for world size " << g_rt.world_size;
}

// A vocabulary that TP pads differently from one rank: 256 tokens with Megatron's default
// --make-vocab-size-divisible-by 128 is 256 rows on one rank and 512 at TP 4 (two of the four
// slices are padding only). The padding takes no part in the softmax, the loss or the gradients,
// so TP 4 trains the one-rank model: the per-step values and the model's rows of the embedding
// and head within the parity row, and the padding rows exactly zero (zero init, zero gradient,
// so AdamW's weight decay leaves them at zero).
template <typename T>
void padded_vocabulary_parity(bool dropout, bool sp) {
  if (g_rt.world_size != 4) GTEST_SKIP() << "TP 4 needs 4 ranks";
  std::optional<MegatronModel> megatron;
  if (dropout) megatron.emplace();
  const std::vector<std::string> args = {"--hidden-size",
                                         "32",
                                         "--num-attention-heads",
                                         "4",
                                         "--seq-length",
                                         "16",
                                         "--num-layers",
                                         "2",
                                         "--num-experts",
                                         "8",
                                         "--moe-ffn-hidden-size",
                                         "16",
                                         "--ffn-hidden-size",
                                         "32",
                                         "--vocab-size",
                                         "256",
                                         "--make-vocab-size-divisible-by",
                                         "128",
                                         "--untie-embeddings-and-output-weights",
                                         "--micro-batch-size",
                                         "1",
                                         "--global-batch-size",
                                         "8",
                                         "--log-interval",
                                         "1000",
                                         "--peak-tflops",
                                         "0.1",
                                         "--train-iters",
                                         "10",
                                         "--lr-warmup-iters",
                                         "2",
                                         "--moe-aux-loss-coeff",
                                         "1e-2",
                                         "--clip-grad",
                                         "0.5"};
  std::vector<std::string> tp_args =
      args + std::vector<std::string>{"--tensor-model-parallel-size", "4"};
  if (sp) tp_args.push_back("--sequence-parallel");
  const Run ref = train_run<T>(args, nullptr);
  parallel::ParallelConfig cfg;
  cfg.tp = 4;
  cfg.sequence_parallel = sp;
  parallel::ProcessGroups groups = make_groups(cfg, tp_args);
  Run got = train_run<T>(tp_args, &groups);
  const std::string what = fmt::format("{} tp=4{} vocabulary 256 padded to 512{}", dtype_str<T>(),
                                       sp ? " sp" : "", dropout ? " dropout" : "");
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    ASSERT_TRUE(got.weights.count(name) && ref.weights.count(name)) << what << " " << name;
    std::vector<double>& w = got.weights[name];
    const size_t model = ref.weights.at(name).size();
    ASSERT_EQ(w.size(), 2 * model) << what << " " << name << ": 512 rows at TP 4, 256 on one rank";
    for (size_t i = model; i < w.size(); ++i)
      ASSERT_EQ(w[i], 0.0) << what << " " << name << " padding element " << i - model;
    w.resize(model);  // the model's rows, compared below
  }
  report(what, compare(got, ref, parity_tol<T>(), what));
  // Where the weights came out bitwise the one-rank run's, so does the digest: it counts the
  // model's rows only.
  if (got.weights == ref.weights) {
    EXPECT_EQ(got.digest, ref.digest) << what;
  }
  expect_replicas_equal(got, groups, what);
}

TEST(TensorParallelPaddedVocabularyParity, Tp4F32) {
  padded_vocabulary_parity<float>(false, false);
}
TEST(TensorParallelPaddedVocabularyParity, Tp4SpDropoutF32) {
  padded_vocabulary_parity<float>(true, true);
}
TEST(TensorParallelPaddedVocabularyParity, Tp4F64) {
  padded_vocabulary_parity<double>(false, false);
}

TEST(DataParallelValidation, GlobalAuxLossNeedsOneDpRank) {
  if (g_rt.world_size == 1) GTEST_SKIP();
  parallel::ProcessGroups groups = make_groups(1, kBase);
  cli::TrainFlags f = cli::tiny_train_flags();
  parse_flags(f, kBase + std::vector<std::string>{"--moe-router-load-balancing-type",
                                                  "global_aux_loss"});
  try {
    train::Trainer t(f.model, f.train, &groups);
    ADD_FAILURE() << "global_aux_loss accepted with dp " << g_rt.world_size;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("global_aux_loss"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Pipeline parallelism: 10 steps vs one rank (the world size picks the layouts), per-step
// values, every weight gathered from the stages (the tied table's copies compared bitwise), and
// the replicas within each stage.

struct PpLayout {
  int pp = 2, vp = 1, tp = 1, ep = 1;
  bool sp = false;
  const char* dispatcher = "alltoall";
  bool megatron_model = false;  // dropout on
  bool distopt = false;         // --use-distributed-optimizer --overlap-grad-reduce
  bool untied = false;
  int layers = 4;
  int world = 2;
  std::vector<std::string> extra = {};
  int first = 0, last = 0;  // --decoder-first/last-pipeline-num-layers
  std::string layout = "";  // --pipeline-model-parallel-layout
  int cp = 1;               // --context-parallel-size (p2p)
  bool even() const { return vp == 1 && first == 0 && last == 0 && layout.empty(); }
};

std::vector<std::string> pp_args(const PpLayout& l) {
  std::vector<std::string> a = {
      "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
      "--num-layers", std::to_string(l.layers), "--num-experts", "8",
      "--moe-ffn-hidden-size", "16", "--ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "16", "--vocab-size", "64",
      "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "1",
      "--global-batch-size", "8", "--log-interval", "1000", "--peak-tflops", "0.1",
      "--train-iters", "10", "--lr-warmup-iters", "2", "--moe-z-loss-coeff", "1e-3",
      "--clip-grad", "0.5", "--moe-aux-loss-coeff", "1e-2",
      "--moe-token-dispatcher-type", l.dispatcher};
  if (l.untied) a.push_back("--untie-embeddings-and-output-weights");
  return a + l.extra;
}

std::string pp_name(const PpLayout& l) {
  return fmt::format("pp={}{}{}{} tp={}{}{} ep={} dp={} {}{}{}{}{}", l.pp,
                     l.vp > 1 ? fmt::format(" vp={}", l.vp) : "",
                     l.first + l.last > 0 ? fmt::format(" first={} last={}", l.first, l.last) : "",
                     l.layout.empty() ? "" : " layout " + l.layout, l.tp, l.sp ? " sp" : "",
                     l.cp > 1 ? fmt::format(" cp={}", l.cp) : "", l.ep,
                     l.world / (l.pp * l.tp * l.cp), l.dispatcher, l.megatron_model ? " dropout" : "",
                     l.untied ? " untied" : " tied", l.distopt ? " dist-opt" : "",
                     l.extra.empty() ? "" : " " + fmt::format("{}", fmt::join(l.extra, " ")));
}

const std::vector<PpLayout> kPpLayouts = {
    // 2 ranks
    {.pp = 2, .world = 2},
    {.pp = 2, .untied = true, .world = 2},
    {.pp = 2, .dispatcher = "allgather", .megatron_model = true, .world = 2},
    {.pp = 2, .vp = 2, .world = 2},
    {.pp = 2, .vp = 2, .untied = true, .layers = 8, .world = 2,
     .extra = {"--microbatch-group-size-per-virtual-pipeline-stage", "3"}},
    {.pp = 2, .layers = 5, .world = 2, .first = 1},
    {.pp = 4, .layers = 6, .world = 4, .first = 1, .last = 1},
    {.pp = 2, .layers = 5, .world = 2, .layout = "Et|tt|t|tL"},
    // 4 ranks
    {.pp = 4, .world = 4},
    {.pp = 2, .ep = 2, .megatron_model = true, .distopt = true, .world = 4},
    {.pp = 2, .tp = 2, .sp = true, .world = 4},
    {.pp = 4, .vp = 2, .layers = 8, .world = 4},
    {.pp = 2, .vp = 2, .ep = 2, .distopt = true, .world = 4},
    {.pp = 2, .megatron_model = true, .world = 4, .cp = 2},  // context parallelism, dropout
    // 8 ranks
    {.pp = 2, .tp = 2, .ep = 2, .sp = true, .world = 8},
};

template <typename T>
void pipeline_parity(const std::vector<PpLayout>& list = kPpLayouts) {
  int layouts = 0;
  for (const PpLayout& l : list) {
    if (l.world != g_rt.world_size) continue;
    std::optional<MegatronModel> megatron;
    if (l.megatron_model) megatron.emplace();
    const std::vector<std::string> args = pp_args(l);
    const Run ref = train_run<T>(args, nullptr);
    parallel::ParallelConfig cfg;
    cfg.pp = l.pp;
    cfg.tp = l.tp;
    cfg.cp = l.cp;
    cfg.ep = l.ep;
    cfg.sequence_parallel = l.sp;
    cfg.vp_stages = l.vp > 1 && l.layout.empty() ? l.vp : 0;
    cfg.first_stage_layers = l.first;
    cfg.last_stage_layers = l.last;
    cfg.layout = l.layout;
    for (size_t i = 0; i + 1 < l.extra.size(); ++i) {
      if (l.extra[i] == "--microbatch-group-size-per-virtual-pipeline-stage")
        cfg.microbatch_group_size = std::stoi(l.extra[i + 1]);
    }
    parallel::ProcessGroups groups = make_groups(cfg, args);
    const std::vector<std::string> run_args = l.distopt ? args + kDistOpt + kOverlap : args;
    const Run got = train_run<T>(run_args, &groups);
    const std::string what = fmt::format("{} {}", dtype_str<T>(), pp_name(l));
    report(what, compare(got, ref, parity_tol<T>(), what));
    expect_replicas_equal(got, groups, what);
    // The stage holds its share of the layers, and every stage but the last kept its inputs
    // and recomputed (1F1B: the last runs each backward right after its forward).
    const int stage = groups.pp_stage();
    if (l.even()) {
      EXPECT_EQ(got.layers.size(), static_cast<size_t>(l.layers / l.pp)) << what;
      if (!got.layers.empty()) {
        EXPECT_EQ(got.layers[0], stage * l.layers / l.pp) << what;
      }
    }
    if (stage < l.pp - 1) {
      EXPECT_GT(got.replays, 0) << what << " stage " << stage;
    }
    if (stage == l.pp - 1 && l.vp == 1 && l.layout.empty()) {
      EXPECT_EQ(got.replays, 0) << what;
    }
    ++layouts;
  }
  if (layouts == 0) GTEST_SKIP() << "no pipeline layout for world size " << g_rt.world_size;
}

TEST(PipelineParity, LayoutsF64) { pipeline_parity<double>(); }
TEST(PipelineParity, LayoutsF32) { pipeline_parity<float>(); }

// ---------------------------------------------------------------------------------------------
// Multi-token prediction: two depths of MoE layers (the decoder's last layer is MoE) after a
// 4-layer model, 10 steps vs one rank: the lm loss, each depth's mtp_k loss, aux, z and grad norm
// per step, and every weight (the depths' parameters and, under PP, the last stage's copy of the
// table, compared bitwise with the first stage's), within the layout-parity row. TP 2 x EP 2 with
// SP (eh_proj column-parallel, the vocab-parallel embedding of the rolled ids), and PP 2 with the
// depths on the last stage, tied (the head's copy serves them) and untied (a copy of their own,
// its gradient summed with the first stage's). With --pipeline-model-parallel-layout the depths
// in a stage before the loss's (Megatron's standalone MTP stage, sending the decoder's and the
// depths' hidden states on together; the table held by the first, the MTP and a tied loss
// stage, its gradient summed over the three): PP 2 with the depths beside the embedding, PP 3,
// PP 2 x VP 2 x EP 2, PP 2 x TP 2 + SP (the boundary's blocks each this rank's sequence slice),
// --bf16; and the depths beside the loss after the stage with the final norm.
struct MtpLayout {
  int tp = 1, ep = 1, pp = 1;
  bool sp = false, untied = false;
  int world = 2;
  bool bf16 = false;  // --bf16 (f32 runs only), on both bf16 GEMM paths
  std::string layout = {};  // --pipeline-model-parallel-layout
};

const std::vector<MtpLayout> kMtpLayouts = {
    // 2 ranks
    {.tp = 2, .ep = 2, .sp = true, .world = 2},
    {.pp = 2, .world = 2},
    {.pp = 2, .untied = true, .world = 2},
    // 4 ranks: data parallelism beside them, TP with PP
    {.tp = 2, .ep = 2, .sp = true, .world = 4},
    {.ep = 2, .pp = 2, .world = 4},
    {.tp = 2, .pp = 2, .sp = true, .untied = true, .world = 4},
    // --bf16: eh_proj's bf16 GEMMs column-parallel, the heads' bf16 inputs written again before
    // each backward (vocab-parallel, and on the last stage)
    {.tp = 2, .ep = 2, .sp = true, .world = 2, .bf16 = true},
    {.pp = 2, .untied = true, .world = 2, .bf16 = true},
    {.tp = 2, .ep = 2, .sp = true, .world = 4, .bf16 = true},
    // Standalone MTP stages, 2, 3 and 4 ranks
    {.pp = 2, .world = 2, .layout = "Ettttmm|L"},
    {.pp = 2, .untied = true, .world = 2, .layout = "Etttt|mmL"},
    {.pp = 3, .world = 3, .layout = "Ett|ttmm|L"},
    {.pp = 3, .untied = true, .world = 3, .layout = "Ett|ttmm|L"},
    {.ep = 2, .pp = 2, .world = 4, .layout = "Ett|t|tmm|L"},
    {.tp = 2, .pp = 2, .sp = true, .world = 4, .layout = "Ettttmm|L"},
    // --bf16: the loss stage's heads on the depths' states it received
    {.pp = 2, .untied = true, .world = 2, .bf16 = true, .layout = "Ettttmm|L"},
};

std::vector<std::string> mtp_args(const MtpLayout& l) {
  std::vector<std::string> a = {
      "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
      "--num-query-groups", "2", "--seq-length", "16", "--num-layers", "4", "--num-experts", "8",
      "--moe-ffn-hidden-size", "16", "--ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "16", "--vocab-size", "64",
      "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "1",
      "--global-batch-size", "8", "--log-interval", "1000", "--peak-tflops", "0.1",
      "--train-iters", "10", "--lr-warmup-iters", "2", "--moe-z-loss-coeff", "1e-3",
      "--clip-grad", "0.5", "--moe-aux-loss-coeff", "1e-2",
      "--moe-token-dispatcher-type", "alltoall", "--mtp-num-layers", "2",
      "--mtp-loss-scaling-factor", "0.3"};
  if (l.untied) a.push_back("--untie-embeddings-and-output-weights");
  if (l.bf16) a.push_back("--bf16");
  return a;
}

template <typename T>
void mtp_parity(bool bf16) {
  int layouts = 0;
  for (const MtpLayout& l : kMtpLayouts) {
    if (l.world != g_rt.world_size || l.bf16 != bf16) continue;
    const std::vector<std::string> args = mtp_args(l);
    const ParityOptions opt = parity_options(bf16);
    const Run ref = train_run<T>(args, nullptr, opt.ref);
    parallel::ParallelConfig cfg;
    cfg.tp = l.tp;
    cfg.etp = l.tp > 1 ? 1 : 0;
    cfg.ep = l.ep;
    cfg.pp = l.pp;
    cfg.sequence_parallel = l.sp;
    cfg.layout = l.layout;
    parallel::ProcessGroups groups = make_groups(cfg, args);
    const Run got = train_run<T>(args, &groups, opt.layout);
    const std::string what =
        fmt::format("{} mtp 2 tp={}{} ep={} pp={}{} dp={} {}{}", dtype_str<T>(), l.tp,
                    l.sp ? " sp" : "", l.ep, l.pp, l.layout.empty() ? "" : " " + l.layout,
                    l.world / (l.tp * l.pp), l.untied ? "untied" : "tied", l.bf16 ? " bf16" : "");
    const Tol tol = bf16 ? bf16_parity_tol() : parity_tol<T>();
    report(what, compare(got, ref, tol, what));
    if (bf16) expect_bf16_steps_close(got, ref, what);
    if (bf16) expect_bf16_routed_weights_close(got, ref, what);
    expect_replicas_equal(got, groups, what);
    // The depths ran: their losses are there, and their parameters among the weights compared.
    EXPECT_GT(ref.metrics.front().mtp_loss[1], 0.0) << what;
    EXPECT_EQ(ref.metrics.front().mtp_loss[2], 0.0) << what;
    EXPECT_EQ(got.weights.count("mtp.layers.1.eh_proj.weight"), 1u) << what;
    EXPECT_EQ(got.weights.count("mtp.layers.0.transformer_layer.mlp.router.weight"), 1u) << what;
    ++layouts;
  }
  if (layouts == 0) GTEST_SKIP() << "no MTP layout for world size " << g_rt.world_size;
}

TEST(MtpParity, LayoutsF64) { mtp_parity<double>(false); }
TEST(MtpParity, LayoutsF32) { mtp_parity<float>(false); }
TEST(MtpParity, LayoutsBf16) {
  testing::for_each_bf16_gemm_path([](ops::Bf16GemmPath p) {
    SCOPED_TRACE(ops::bf16_gemm_path_name(p));
    mtp_parity<float>(true);
  });
}

// ---- Context parallelism ----
// The sequence split over the cp ranks (Megatron's load-balanced chunks r and 2 cp - 1 - r), the
// attention across them by --cp-comm-type (p2p ring or allgather; a list gives each layer its
// own), alone and folded with TP + SP, EP (expert groups over dp x cp), DP with the distributed
// optimizer and dropout (Megatron's default model: learned positions, hidden and attention
// dropout keyed by global positions), MLA. 10 steps vs 1 rank, f64 and f32: per-step lm, aux, z,
// grad norm and every weight.
struct CpLayout {
  int cp = 2, tp = 1, etp = 0, ep = 1;
  bool sp = false;
  std::vector<std::string> comm = {"p2p"};
  bool megatron_model = false;  // dropout on
  bool distopt = false;         // --use-distributed-optimizer --overlap-grad-reduce
  bool mla = false;
  int pp = 1;
  std::string layout = {};  // --pipeline-model-parallel-layout
  bool bf16 = false;        // --bf16: ContextParallelParity.LayoutsBf16 only
  int world = 0;
  std::vector<std::string> extra = {};  // flags added to the layout's model
  const char* note = "";
};

// seq_aux_loss on micro-batches of two sequences: its per-sequence counts summed over tp x cp.
const std::vector<std::string> kCpSeqAux = {"--moe-router-load-balancing-type", "seq_aux_loss",
                                            "--micro-batch-size", "2"};
// Two MTP depths: their ids and targets rolled on the whole sequences before the split.
const std::vector<std::string> kCpMtp = {"--mtp-num-layers", "2", "--mtp-loss-scaling-factor",
                                         "0.3"};

const std::vector<CpLayout> kCpLayouts = {
    // 2 ranks
    {.cp = 2, .world = 2},
    {.cp = 2, .comm = {"allgather"}, .world = 2},
    {.cp = 2, .comm = {"allgather", "p2p"}, .world = 2},  // one type per layer
    {.cp = 2, .etp = 1, .ep = 2, .world = 2},             // EP folded over cp
    {.cp = 2, .megatron_model = true, .world = 2},
    {.cp = 2, .mla = true, .world = 2},
    {.cp = 2, .world = 2, .extra = kCpSeqAux, .note = " seq_aux"},
    {.cp = 2, .world = 2, .extra = kCpMtp, .note = " mtp"},
    // 4 ranks
    {.cp = 4, .world = 4},
    {.cp = 4, .comm = {"allgather"}, .world = 4},
    {.cp = 2, .tp = 2, .sp = true, .world = 4},
    {.cp = 2, .etp = 1, .ep = 2, .distopt = true, .world = 4},  // DP 2, EP 2 x EDP 2
    {.cp = 2, .tp = 2, .etp = 1, .ep = 2, .sp = true, .megatron_model = true, .world = 4},
    {.cp = 2, .tp = 2, .etp = 1, .ep = 2, .sp = true, .world = 4, .extra = kCpMtp,
     .note = " mtp"},
    // The MTP depths in a stage before the loss's: the loss stage's MtpLoss takes the targets
    // rolled on the whole sequences too.
    {.cp = 2, .pp = 2, .layout = "Ettmm|L", .world = 4, .extra = kCpMtp, .note = " mtp"},
    // --bf16: the attention across ranks on the bf16 layers' f32 activations
    {.cp = 2, .bf16 = true, .world = 2},
    {.cp = 2, .comm = {"allgather"}, .mla = true, .bf16 = true, .world = 2},
    {.cp = 2, .tp = 2, .etp = 1, .ep = 2, .sp = true, .bf16 = true, .world = 4},
    // 8 ranks: TP 2 + SP x CP 2 x DP 2 with EP 4 x EDP 2, dropout, the distributed optimizer
    {.cp = 2, .tp = 2, .etp = 1, .ep = 4, .sp = true, .megatron_model = true, .distopt = true,
     .world = 8},
};

std::string cp_name(const CpLayout& l) {
  const int etp = l.etp > 0 ? l.etp : l.tp;
  return fmt::format("cp={} {} tp={}{} pp={}{} dp={} | ep={} etp={} edp={}{}{}{}{}", l.cp,
                     fmt::join(l.comm, ","), l.tp, l.sp ? " sp" : "", l.pp,
                     l.layout.empty() ? "" : " " + l.layout, l.world / (l.tp * l.cp * l.pp),
                     l.ep, etp, l.world / (l.ep * etp * l.pp), l.megatron_model ? " dropout" : "",
                     l.distopt ? " dist-opt" : "", l.mla ? " mla" : "", l.note);
}

template <typename T>
void context_parallel_parity(bool bf16, const std::vector<CpLayout>& list = kCpLayouts) {
  int layouts = 0;
  for (const CpLayout& l : list) {
    if (l.world != g_rt.world_size || l.bf16 != bf16) continue;
    std::optional<MegatronModel> megatron;
    if (l.megatron_model) megatron.emplace();
    std::vector<std::string> args = tp_args(TpLayout{.tp = l.tp, .mla = l.mla}) + l.extra;
    if (l.distopt) args = args + kDistOpt + kOverlap;
    if (l.bf16) args.push_back("--bf16");
    const ParityOptions opt = parity_options(bf16);
    const Run ref = train_run<T>(args, nullptr, opt.ref);
    parallel::ParallelConfig cfg;
    cfg.cp = l.cp;
    cfg.cp_comm_type = l.comm;
    cfg.tp = l.tp;
    cfg.etp = l.etp;
    cfg.ep = l.ep;
    cfg.sequence_parallel = l.sp;
    cfg.pp = l.pp;
    cfg.layout = l.layout;
    parallel::ProcessGroups groups = make_groups(cfg, args);
    const Run got = train_run<T>(args, &groups, opt.layout);
    const std::string what =
        fmt::format("{} {}{}", dtype_str<T>(), cp_name(l), l.bf16 ? " bf16" : "");
    const Tol tol = bf16 ? bf16_parity_tol() : parity_tol<T>();
    report(what, compare(got, ref, tol, what));
    if (bf16) expect_bf16_steps_close(got, ref, what);
    if (bf16) expect_bf16_routed_weights_close(got, ref, what);
    expect_replicas_equal(got, groups, what);
    // The aux and z losses ran (their counts over tp x cp are what the comparison checks).
    EXPECT_GT(ref.metrics.front().aux_loss, 0.0) << what;
    EXPECT_GT(ref.metrics.front().z_loss, 0.0) << what;
    if (!l.extra.empty() && l.extra == kCpMtp) {
      EXPECT_GT(ref.metrics.front().mtp_loss[1], 0.0) << what;
      EXPECT_EQ(got.weights.count("mtp.layers.1.eh_proj.weight"), 1u) << what;
    }
    ++layouts;
  }
  if (layouts == 0) GTEST_SKIP() << "no context-parallel layout for world size " << g_rt.world_size;
}

TEST(ContextParallelParity, LayoutsF64) { context_parallel_parity<double>(false); }
TEST(ContextParallelParity, LayoutsF32) { context_parallel_parity<float>(false); }
TEST(ContextParallelParity, LayoutsBf16) { context_parallel_parity<float>(true); }

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing::run_mpi_tests(argc, argv, &moecore::g_rt);
}

