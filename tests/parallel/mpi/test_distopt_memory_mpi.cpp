// The distributed optimizer's memory per rank under mpirun (2 and 4 ranks), for data parallel
// 1 (each rank alone), 2 and 4 and expert data parallel 1, 2 and 4 (EP = world / EDP), in fp32
// and --bf16: each rank's Adam state is m and v of exactly its owned elements (its shards of the
// gradient buckets; every element owned by one rank of the group), the weights and gradients
// are whole (no second gradient buffer), under --bf16 the fp32 master weights are sharded with
// the moments, the bytes per parameter follow the formula (fp32: 8 + 8/d; --bf16: Megatron's
// 6 + 12/d sharded, plus the f32 copies of the bf16 values f32 kernels read) up to the router
// buffers, the arenas' alignment and the
// ceil(n/d) shard rounding, the start-up line and the metrics show the sharding, and the
// planner's sizing pass (`moecore plan`) gives the trainer's bytes, kind by kind; with pipeline
// parallelism (PP 2 on 2 ranks, PP 2 x VP 2 with DP 2 on 4) each stage's model, pipeline runner
// and optimizer bytes equal the planner's for that stage.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "cli/train_flags.h"
#include "common/mpi_testing.h"
#include "common/tiny_train_flags.h"
#include "core/check.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"
#include "plan/memory_model.h"
#include "train/trainer.h"

namespace moecore {
namespace {

parallel::Runtime g_rt;

// Tiny (tiny_mpi_args: two MoE layers of 8 experts, global batch 8), one step.
std::vector<std::string> base_args() {
  std::vector<std::string> a = cli::tiny_mpi_args();
  for (const char* w : {"--train-iters", "1", "--lr-warmup-iters", "0",
                        "--use-distributed-optimizer"})
    a.push_back(w);
  return a;
}
const std::vector<std::string> kBase = base_args();

cli::TrainFlags flags(std::vector<std::string> args) {
  cli::TrainFlags f = cli::tiny_train_flags();
  CLI::App app;
  cli::add_train_flags(app, f);
  std::reverse(args.begin(), args.end());  // CLI11 takes them reversed
  app.parse(args);
  cli::finalize_train_flags(f);
  return f;
}

// The arena's 64-byte granule.
int64_t up64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// |measured - formula| per parameter: the router buffers (expert bias and quantile beta, 2 x E
// floats per MoE layer) among the weights, the 64-byte alignment of each buffer and the shard
// rounding (a rank owns ceil(n/d) or fewer of a bucket's n elements) stay below this for the
// tiny model (~40k parameters); the formula's d steps are >= 1 B apart.
constexpr double kFormulaSlack = 0.05;

struct Layout {
  int ep = 1;      // world / ep = expert data parallel; 0: each rank trains alone (DP 1)
  bool bf16 = false;
};

void check_layout(const Layout& l) {
  const bool alone = l.ep == 0;
  const int world = alone ? 1 : g_rt.world_size;
  std::vector<std::string> args = kBase;
  if (l.bf16) args.push_back("--bf16");
  const cli::TrainFlags f = flags(args);
  parallel::ParallelConfig pc;
  pc.ep = alone ? 1 : l.ep;
  pc.timeout_minutes = 1.0;  // a deadlock ends with a diagnostic, not a ctest timeout
  std::unique_ptr<parallel::ProcessGroups> groups;
  if (!alone) {
    groups = std::make_unique<parallel::ProcessGroups>(
        parallel::init_process_groups(pc, g_rt, cli::model_dims(f.model)));
  }
  const std::string what = fmt::format("world {} ep {}{}", world, pc.ep, l.bf16 ? " bf16" : "");
  SCOPED_TRACE(what);

  train::Trainer trainer(f.model, f.train, groups.get());
  std::ostringstream log;
  const std::vector<train::StepMetrics> ms = trainer.run(log);
  ASSERT_FALSE(ms.empty());
  const train::StepMetrics& m = ms.back();
  const ParamRegistry& p = trainer.model().params();
  const parallel::GradBuckets& b = trainer.grad_buckets();
  const Arena& ma = trainer.model().arena();

  // The groups each kind's state is sharded over: dp x cp = world, expt_dp = world / ep.
  const int want_d[2] = {world, world / pc.ep};
  int64_t owned[2], numel[2];
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const int i = static_cast<int>(k);
    numel[i] = p.numel(k);
    EXPECT_EQ(b.shard_degree(k), want_d[i]) << i;
    EXPECT_EQ(m.optim_shard_degree[i], want_d[i]) << i;
    owned[i] = b.sharded() ? b.owned_numel(k) : numel[i];
    // Every element is owned by exactly one rank of the kind's group; none owns more than its
    // ceil(n / d) of each bucket.
    int64_t bound = 0;
    for (size_t j = 0; j < b.buckets().size(); ++j) {
      if (b.buckets()[j].kind != k) continue;
      bound += (b.buckets()[j].count + want_d[i] - 1) / want_d[i];
    }
    EXPECT_LE(owned[i], bound) << i;
    std::vector<int64_t> sum = {owned[i]};
    if (const parallel::ProcessGroup* g = b.group(k); g != nullptr && g->size() > 1) {
      g->communicator().all_reduce(sum);
    }
    EXPECT_EQ(sum[0], numel[i]) << "kind " << i << ": the owned elements over the group";
  }

  // Optimizer state: Adam m and v (fp32) of the owned elements, per kind; under --bf16 with the
  // state sharded, the fp32 master weights of the owned elements too (the registry holds none).
  const bool sharded = want_d[0] > 1 || want_d[1] > 1;
  const bool master_sharded = l.bf16 && sharded;
  EXPECT_EQ(p.holds_master(), !master_sharded);
  const int64_t opt = trainer.optimizer().state_bytes(MemKind::OptimizerState);
  EXPECT_EQ(opt, (master_sharded ? 3 : 2) * (up64(4 * owned[0]) + up64(4 * owned[1])));
  // The metrics' optimizer kind adds the routers' expert-bias / quantile counters (model arena).
  EXPECT_EQ(m.mem_bytes[static_cast<int>(MemKind::OptimizerState)],
            opt + static_cast<int64_t>(ma.bytes_of(MemKind::OptimizerState)));
  // Gradients: the flat buffers, whole (the reduce-scatter works in place); values whole too.
  const int64_t es = static_cast<int64_t>(dtype_size(p.dtype()));
  EXPECT_EQ(static_cast<int64_t>(ma.bytes_of(MemKind::Grads)),
            up64(es * numel[0]) + up64(es * numel[1]));
  // --bf16: the compute copy, bf16 or (the widened-bf16 GEMM path) f32, and on the native path
  // the f32 copies of the bf16 values f32 kernels read (every parameter but the GEMM weights).
  const bool widened = l.bf16 && p.params().front().has_data16w;
  const int64_t copy = !l.bf16 ? 0 : widened ? 4 : 2;
  const int64_t master = master_sharded ? 0 : es;
  int64_t n32[2] = {0, 0};
  for (const Param& q : p.params()) {
    if (l.bf16 && !widened && !q.spec.bf16_only) n32[static_cast<int>(q.spec.kind)] += q.local_numel();
  }
  EXPECT_EQ(p.values32_numel(ParamKind::Dense), n32[0]);
  EXPECT_EQ(p.values32_numel(ParamKind::Expert), n32[1]);
  if (l.bf16 && !widened) {
    EXPECT_GT(n32[0], 0);
  }
  const int64_t values = (master > 0 ? up64(master * numel[0]) + up64(master * numel[1]) : 0) +
                         (copy > 0 ? up64(copy * numel[0]) + up64(copy * numel[1]) : 0) +
                         up64(4 * n32[0]) + up64(4 * n32[1]);
  EXPECT_GE(static_cast<int64_t>(ma.bytes_of(MemKind::Weights)), values);

  // Bytes per parameter: measured == what the arenas hold; close to the formula.
  const double n = static_cast<double>(numel[0] + numel[1]);
  const double held = static_cast<double>(ma.bytes_of(MemKind::Weights) +
                                          ma.bytes_of(MemKind::Grads) + opt);
  EXPECT_DOUBLE_EQ(m.state_bytes_per_param, held / n);
  double formula = 0;
  for (int i = 0; i < 2; ++i) {
    formula += static_cast<double>(numel[i]) * (master + copy + es) + 4.0 * n32[i] +
               static_cast<double>(numel[i]) * (master_sharded ? 12.0 : 8.0) / want_d[i];
  }
  formula /= n;
  EXPECT_NEAR(m.state_bytes_per_param_formula, formula, 1e-12);
  EXPECT_NEAR(m.state_bytes_per_param, formula, kFormulaSlack);
  // Megatron's rows (without the f32 copies of the bf16 values of the norms, biases, routers
  // and embeddings, which Megatron's f32 kernels cast on the fly).
  const double copies32 = 4.0 * static_cast<double>(n32[0] + n32[1]) / n;
  if (want_d[0] == want_d[1]) {
    const double d = want_d[0];
    if (!l.bf16) {
      EXPECT_DOUBLE_EQ(formula, 8.0 + 8.0 / d);  // fp32: 8 + 8/d
    }
    if (l.bf16 && !widened && sharded) {
      EXPECT_NEAR(formula - copies32, 6.0 + 12.0 / d, 1e-12);
    }
    if (l.bf16 && !widened && !sharded) {
      EXPECT_NEAR(formula - copies32, 18.0, 1e-12);
    }
  }

  // The start-up line says it.
  const std::string header = log.str();
  EXPECT_NE(header.find("[train] memory per parameter: weights + grads + optimizer state"),
            std::string::npos)
      << header;
  if (want_d[0] > 1 || want_d[1] > 1) {
    EXPECT_NE(header.find(fmt::format("sharded over dp_cp {} (dense) and expt_dp {} (expert)",
                                      want_d[0], want_d[1])),
              std::string::npos)
        << header;
  } else {
    EXPECT_NE(header.find("whole on every rank"), std::string::npos) << header;
  }

  // The planner's sizing pass for this rank equals the trainer's arenas, kind by kind.
  parallel::GradReduceConfig ddp;
  ddp.distributed_optimizer = true;
  const plan::ArenaSizes a = plan::trainer_arena_sizes(
      f.model, f.train.micro_batch, pc, world, alone ? 0 : g_rt.rank, Device::CPU, ddp);
  for (int k = 0; k < kNumMemKinds; ++k) {
    EXPECT_EQ(a.by_kind[k], static_cast<double>(m.mem_bytes[k]))
        << mem_kind_name(static_cast<MemKind>(k));
  }
  EXPECT_EQ(a.planned, static_cast<double>(m.mem_planned_bytes));
  EXPECT_EQ(a.shard_degree[0], want_d[0]);
  EXPECT_EQ(a.shard_degree[1], want_d[1]);

  if (g_rt.rank == 0) {
    std::printf("[distopt] %-22s dp %d, edp %d: %.3f B/param measured, formula %.3f "
                "(optimizer %lld B, grads %lld B, weights %lld B, %lld params)\n",
                what.c_str(), want_d[0], want_d[1], m.state_bytes_per_param, formula,
                static_cast<long long>(opt), static_cast<long long>(ma.bytes_of(MemKind::Grads)),
                static_cast<long long>(ma.bytes_of(MemKind::Weights)),
                static_cast<long long>(numel[0] + numel[1]));
  }
}

// Pipeline stages: the planner's stage (its chunks from pipeline_layout, the runner's buffers
// from pipeline_buffer_sizes) equals what this rank's trainer planned: the model arena and the
// optimizer (mem_planned_bytes, kind by kind) and the runner's own arena.
TEST(DistOptMemory, PipelineStagesEqualThePlanner) {
  const int world = g_rt.world_size;
  if (world != 2 && world != 4) GTEST_SKIP() << "PP 2 on 2 ranks, PP 2 x VP 2 on 4";
  std::vector<std::string> args = kBase;
  const int vp = world == 4 ? 2 : 1;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--num-layers") args[i + 1] = std::to_string(2 * vp);
  }
  for (bool tied : {true, false}) {
    std::vector<std::string> a = args;
    if (!tied) a.push_back("--untie-embeddings-and-output-weights");
    const cli::TrainFlags f = flags(a);
    parallel::ParallelConfig pc;
    pc.pp = 2;
    pc.vp_stages = vp > 1 ? vp : 0;
    pc.timeout_minutes = 1.0;
    parallel::ProcessGroups groups =
        parallel::init_process_groups(pc, g_rt, cli::model_dims(f.model));
    const std::string what = fmt::format("world {} pp 2 vp {}{}", world, vp, tied ? " tied" : "");
    SCOPED_TRACE(what);
    train::Trainer trainer(f.model, f.train, &groups);
    std::ostringstream log;
    const std::vector<train::StepMetrics> ms = trainer.run(log);
    ASSERT_FALSE(ms.empty());
    const train::StepMetrics& m = ms.back();
    const int dp = world / 2;
    const int64_t n_micro = f.train.global_batch / (f.train.micro_batch * dp);
    parallel::GradReduceConfig ddp;
    ddp.distributed_optimizer = true;
    const plan::ArenaSizes p = plan::trainer_arena_sizes(f.model, f.train.micro_batch, pc, world,
                                                         g_rt.rank, Device::CPU, ddp, n_micro);
    for (int k = 0; k < kNumMemKinds; ++k) {
      EXPECT_EQ(p.by_kind[k], static_cast<double>(m.mem_bytes[k]))
          << mem_kind_name(static_cast<MemKind>(k));
    }
    EXPECT_EQ(p.planned, static_cast<double>(m.mem_planned_bytes));
    const double runner = static_cast<double>(trainer.pipeline_runner().planned_bytes());
    EXPECT_GT(runner, 0);
    EXPECT_EQ(p.pipeline_planned, runner);
    std::printf("[pp memory] %s rank %d (stage %d): trainer model+optimizer %lld B + runner %.0f "
                "B; planner %.0f + %.0f B\n",
                what.c_str(), g_rt.rank, groups.pp_stage(),
                static_cast<long long>(m.mem_planned_bytes), runner, p.planned,
                p.pipeline_planned);
  }
}

TEST(DistOptMemory, DataParallelOne) {
  for (bool bf16 : {false, true}) check_layout({0, bf16});
}

TEST(DistOptMemory, EveryExpertParallelSize) {
  // EP 1: dp = edp = world; EP 2: edp = world / 2; EP = world: edp 1 (the expert state whole).
  for (int ep = 1; ep <= g_rt.world_size; ep *= 2) {
    for (bool bf16 : {false, true}) check_layout({ep, bf16});
  }
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing::run_mpi_tests(argc, argv, &moecore::g_rt);
}
