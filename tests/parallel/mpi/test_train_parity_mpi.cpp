// Layout parity under mpirun: the same global model trained for 10 steps on the same global
// batch must give the 1-rank run's per-step lm loss, aux and z values and grad norm, and the same
// final weights (expert slices gathered over EP), within the "layout parity" rows of
// docs/numerics.md. The world size picks the layouts: data parallelism alone (EP 1, DP = world),
// and every EP in {2, 4, 8} dividing the world and the experts (expert-data-parallel size
// world / EP), with both dispatchers. Each rank also trains the 1-rank reference itself (tiny
// model), so nothing has to be shipped around. --overlap-grad-reduce must give bitwise the same
// run as the reduction after the backward, and data-parallel replicas must stay bitwise equal.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/mpi_testing.h"
#include "common/testing.h"
#include "common/tiny_train_flags.h"
#include "common/tolerances.h"
#include "core/check.h"
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
  // The optimizer's state bytes and this rank's owned elements per kind (dense, expert), and
  // the registry's element counts (--use-distributed-optimizer).
  int64_t state_bytes = 0;
  int64_t owned[2] = {0, 0}, numel[2] = {0, 0};
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

// The global tensor of parameter p from every rank's local values, whatever its slice (EP's
// experts, TP's rows or columns in parts, ETP inside an EP slice): each rank adds its values at
// their global indices (param_global_index) and a count of holders; summed over the world, each
// element is divided by its holders (replicas hold equal values; the world sizes here are powers
// of two, so the sum and the division are exact). Every element must be held by some rank.
std::vector<double> gather_global(const Param& p, const std::vector<double>& local,
                                  const parallel::ProcessGroups& groups) {
  const size_t n = static_cast<size_t>(p.global_numel());
  std::vector<double> sum(n, 0.0), holders(n, 0.0);
  for (int64_t i = 0; i < p.local_numel(); ++i) {
    const auto g = static_cast<size_t>(param_global_index(p, i));
    sum[g] += local[static_cast<size_t>(i)];
    holders[g] += 1;
  }
  groups.world().communicator().all_reduce(sum);
  groups.world().communicator().all_reduce(holders);
  for (size_t g = 0; g < n; ++g) {
    EXPECT_GT(holders[g], 0) << p.name() << " element " << g << " is held by no rank";
    if (holders[g] > 0) sum[g] /= holders[g];
  }
  return sum;
}

// Trains with `args`; groups null = the 1-rank reference.
template <typename T>
Run train_run(const std::vector<std::string>& args, const parallel::ProcessGroups* groups) {
  cli::TrainFlags f = base_flags();
  parse_flags(f, args);
  train::BasicTrainer<T> trainer(f.model, f.train, groups);
  std::ostringstream log;
  Run r;
  r.metrics = trainer.run(log);
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
  const ModelConfig& mc = f.model;
  r.k_rows = mc.head_dim();
  r.q_rows = mc.num_heads / mc.num_query_groups * mc.head_dim();
  r.qkv_group_rows = r.q_rows + 2 * r.k_rows;
  const ParamRegistry& params = trainer.model().params();
  for (const Param& p : params.params()) {
    std::vector<double> local = master_values(trainer, p, groups);
    if (p.local_numel() == p.global_numel()) {  // the whole tensor
      r.weights[p.name()] = std::move(local);
      continue;
    }
    EXPECT_NE(groups, nullptr) << p.name() << " is sliced on one rank";
    if (groups == nullptr) continue;
    r.weights[p.name()] = gather_global(p, local, *groups);
  }
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
};

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

struct Tol {
  double metric_rtol;  // per-step lm loss, aux, z, grad norm
  double weight_rtol, weight_atol;
};

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
    for (size_t i = 0; i < want.size(); ++i) {
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
    EXPECT_LE(worst, 1.0) << what << " " << name << "[" << worst_i << "] = " << have[worst_i]
                          << ", 1 rank: " << want[worst_i];
  }
  return d;
}

void report(const std::string& what, const Diff& d) {
  if (g_rt.rank != 0) return;
  std::printf("[parity] %-52s max rel: lm %.2e  aux %.2e  z %.2e  grad norm %.2e  weights %.2e\n",
              what.c_str(), d.lm, d.aux, d.z, d.norm, d.weights);
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

// Replicas: dense weights equal on every rank, expert weights on every rank of the expt_dp group.
void expect_replicas_equal(const Run& r, const parallel::ProcessGroups& groups,
                           const std::string& what) {
  auto check = [&](const parallel::ProcessGroup& g, std::vector<double> v, const char* kind) {
    std::vector<double> root = v;
    g.communicator().broadcast(root, 0);
    EXPECT_TRUE(root == v) << what << ": " << kind << " weights differ from rank 0 of '"
                           << g.name << "' (world rank " << g_rt.rank << ")";
  };
  check(groups.group(parallel::GroupKind::DpCp), r.dense_flat, "dense");
  check(groups.group(parallel::GroupKind::ExptDp), r.expert_flat, "expert");
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
};

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
  return a;
}

std::string tp_name(const TpLayout& l) {
  const int etp = l.etp > 0 ? l.etp : l.tp;
  return fmt::format("tp={}{} dp={} | ep={} etp={} edp={} {}{}{}", l.tp, l.sp ? " sp" : "",
                     l.world / l.tp, l.ep, etp, l.world / (l.ep * etp), l.dispatcher,
                     l.megatron_model ? " dropout" : "", l.bf16 ? " bf16" : "");
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

// --bf16: step 1 runs on the same weights, so its loss and grad norm hold to the f32 row (the
// later steps' bf16 rounding flips compound: kParityBf16Rtol).
void expect_first_step_close(const Run& got, const Run& ref, const std::string& what) {
  ASSERT_FALSE(got.metrics.empty() || ref.metrics.empty()) << what;
  EXPECT_LE(rel(got.metrics[0].lm_loss, ref.metrics[0].lm_loss), testing::kParityF32Rtol)
      << what << " lm loss, step 1";
  EXPECT_LE(rel(got.metrics[0].grad_norm, ref.metrics[0].grad_norm), testing::kParityF32Rtol)
      << what << " grad norm, step 1";
}

template <typename T>
void tensor_parallel_parity(bool bf16) {
  int layouts = 0;
  for (const TpLayout& l : kTpLayouts) {
    if (l.world != g_rt.world_size || l.bf16 != bf16) continue;
    std::optional<MegatronModel> megatron;
    if (l.megatron_model) megatron.emplace();
    const std::vector<std::string> args = tp_args(l);
    const Run ref = train_run<T>(args, nullptr);
    parallel::ParallelConfig cfg;
    cfg.tp = l.tp;
    cfg.etp = l.etp;
    cfg.ep = l.ep;
    cfg.sequence_parallel = l.sp;
    parallel::ProcessGroups groups = make_groups(cfg, args);
    const Run got = train_run<T>(args, &groups);
    const std::string what = fmt::format("{} {}", dtype_str<T>(), tp_name(l));
    const Tol tol = bf16 ? Tol{testing::kParityBf16Rtol, testing::kParityBf16WeightRtol,
                               testing::kParityBf16WeightAtol}
                         : parity_tol<T>();
    report(what, compare(got, ref, tol, what));
    if (bf16) expect_first_step_close(got, ref, what);
    expect_replicas_equal(got, groups, what);
    if (l.distopt) {
      const Run dist = train_run<T>(args + kDistOpt + kOverlap, &groups);
      report(what + " dist-opt", compare(dist, ref, tol, what + " dist-opt"));
      if (bf16) expect_first_step_close(dist, ref, what + " dist-opt");
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
  const ops::Bf16GemmPath path = ops::bf16_gemm_path();
  for (ops::Bf16GemmPath p : {ops::Bf16GemmPath::Native, ops::Bf16GemmPath::Widen}) {
    if (p == ops::Bf16GemmPath::Native && !ops::bf16_native_available()) continue;
    SCOPED_TRACE(ops::bf16_gemm_path_name(p));
    ops::set_bf16_gemm_path(p);
    tensor_parallel_parity<float>(true);
  }
  ops::set_bf16_gemm_path(path);
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

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing::run_mpi_tests(argc, argv, &moecore::g_rt);
}

