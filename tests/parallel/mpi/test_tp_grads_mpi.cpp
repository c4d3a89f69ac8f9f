// Tensor-parallel gradients under mpirun (2 ranks: TP 2 and expert TP 2; 4 and 8 ranks: the
// same with data parallel and expert data parallel 2 and 4): every rank holds its TP slices of the
// sharded parameters and whole copies of the replicated ones, its gradients the rank's share
// of a known global gradient (replicated partial gradients split unevenly over the TP ranks).
// After the gradient buckets every ReplicatedPartialGrad gradient is the global one, the
// others untouched by TP; the gradient norm (plain and distributed optimizer) equals the norm
// of the global gradients, every element counted once; and the digests of the counted
// parameters summed over tp (dense) and tp_ep (expert) equal the digest of the whole tensors.
// With the distributed optimizer at 4 and 8 ranks the optimizer state is sharded over dp / expt_dp
// (asserted: each rank's moments hold about 1/d of the elements); at 2 ranks nothing is.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/mpi_testing.h"
#include "nn/param_registry.h"
#include "optim/chained_optimizer.h"
#include "parallel/grad_buckets.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"
#include "train/trainer.h"

namespace moecore {
namespace {

parallel::Runtime g_rt;

struct Spec {
  const char* name;
  std::vector<int64_t> shape;
  ParamKind kind;
  TpRole role;
  int split_dim;  // Sharded: the dimension split over TP
};
const std::vector<Spec> kSpecs = {
    {"w", {4, 3}, ParamKind::Dense, TpRole::Sharded, 0},
    {"proj", {3, 4}, ParamKind::Dense, TpRole::Sharded, 1},
    {"norm", {3}, ParamKind::Dense, TpRole::ReplicatedPartialGrad, -1},
    {"bias", {2}, ParamKind::Dense, TpRole::Replicated, -1},
    {"fc1", {4, 3}, ParamKind::Expert, TpRole::Sharded, 0},
    {"fc2_bias", {3}, ParamKind::Expert, TpRole::ReplicatedPartialGrad, -1},
    {"expert_rep", {2}, ParamKind::Expert, TpRole::Replicated, -1},
};

// The global gradient: multiples of 1/2, exact in f32 after the scalings below.
double global_grad(const std::string& name, int64_t gi) {
  return 0.5 * static_cast<double>(1 + (name.size() * 5 + gi * 3) % 7);
}

// tp / etp: this rank's shards (size 1: the whole tensors).
void build(ParamRegistry& reg, Arena& arena, TpShard tp, TpShard etp) {
  for (const Spec& s : kSpecs) {
    ParamSpec p{s.name, s.shape, ParamInit::Normal, 0.02, s.kind, true, {}};
    p.tp_role = s.role;
    const TpShard& sh = s.kind == ParamKind::Dense ? tp : etp;
    if (s.split_dim >= 0) p.slice = sh.slice(s.split_dim, s.shape[s.split_dim]);
    reg.add(p);
  }
  arena.plan([&](Arena& a) { reg.allocate(a); });
  reg.init(11);
}

double global_norm() {
  double sq = 0;
  for (const Spec& s : kSpecs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    for (int64_t i = 0; i < n; ++i) sq += global_grad(s.name, i) * global_grad(s.name, i);
  }
  return std::sqrt(sq);
}

void run_case(bool distributed_optimizer) {
  const int world = g_rt.world_size;
  if (world != 2 && world != 4 && world != 8) GTEST_SKIP() << "needs 2, 4 or 8 ranks";
  parallel::ParallelConfig cfg;
  cfg.tp = 2;
  cfg.etp = 2;
  cfg.sequence_parallel = true;
  cfg.timeout_minutes = 1.0;
  parallel::ProcessGroups groups(parallel::make_layout(cfg, world), g_rt.rank);
  parallel::connect_communicators(groups);
  const parallel::ProcessGroup& tp = groups.tp();
  const parallel::ProcessGroup& etp = groups.expt_tp();
  ASSERT_EQ(tp.size(), 2);
  ASSERT_EQ(etp.size(), 2);

  ParamRegistry reg(DType::F32);
  Arena arena;
  build(reg, arena, TpShard{tp.rank, 2}, TpShard{etp.rank, 2});
  // Each data-parallel rank holds 1/dp of the gradient; a partial gradient 1/4 on TP rank 0,
  // 3/4 on TP rank 1.
  for (Param& p : reg.params()) {
    const double dp = p.spec.kind == ParamKind::Dense ? groups.dp_cp().size()
                                                      : groups.expt_dp().size();
    const int tp_rank = p.spec.kind == ParamKind::Dense ? tp.rank : etp.rank;
    const double share = p.spec.tp_role != TpRole::ReplicatedPartialGrad ? 1.0
                         : tp_rank == 0                                  ? 0.25
                                                                         : 0.75;
    float* g = static_cast<float*>(raw_ptr(p.grad));
    for (int64_t l = 0; l < p.local_numel(); ++l) {
      g[l] = static_cast<float>(global_grad(p.name(), param_global_index(p, l)) / dp * share);
    }
  }
  std::vector<std::vector<const Param*>> stages(1);
  for (const Param& p : reg.params()) stages[0].push_back(&p);
  parallel::GradReduceConfig rc;
  rc.distributed_optimizer = distributed_optimizer;
  rc.overlap = true;
  parallel::GradBuckets buckets(reg, stages, &groups.dp_cp(), &groups.expt_dp(), rc, &tp, &etp);
  ASSERT_EQ(buckets.sharded(), distributed_optimizer && world > 1 && groups.dp_cp().size() > 1);
  buckets.arm();
  buckets.stage_done(0);
  buckets.finish();
  if (!buckets.sharded()) {
    for (const Param& p : reg.params()) {
      const float* g = static_cast<const float*>(raw_ptr(p.grad));
      for (int64_t l = 0; l < p.local_numel(); ++l) {
        ASSERT_EQ(g[l], static_cast<float>(global_grad(p.name(), param_global_index(p, l))))
            << p.name() << "[" << l << "]";
      }
    }
  }

  optim::AdamWConfig adam;
  const optim::GradNormSync sync = train::grad_norm_sync(&groups, buckets, reg.exec());
  EXPECT_EQ(static_cast<bool>(sync.counted), tp.rank != 0 || etp.rank != 0);
  std::unique_ptr<optim::ChainedOptimizer> opt;
  if (buckets.sharded()) {
    optim::ShardedState st;
    st.seed = 11;
    for (size_t b = 0; b < buckets.buckets().size(); ++b) {
      const parallel::BucketShard& s = buckets.shard(b);
      st.ranges[static_cast<int>(buckets.buckets()[b].kind)].push_back(
          optim::OwnedRange{s.begin, s.count, s.owned_offset});
    }
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      st.owned_numel[static_cast<int>(k)] = buckets.owned_numel(k);
    }
    st.gather_params = [&buckets] { buckets.gather_params(); };
    opt = std::make_unique<optim::ChainedOptimizer>(reg, adam, sync, st);
  } else {
    opt = std::make_unique<optim::ChainedOptimizer>(reg, adam, sync);
  }
  const optim::StepInfo info = opt->step(1e-3);
  EXPECT_NEAR(info.grad_norm, global_norm(), 1e-12 * global_norm());

  // The optimizer state: with the distributed optimizer each rank's Adam moments hold only its
  // owned elements (8 bytes each, every buffer 64-byte aligned), about 1/d of its kind's (each
  // bucket of n elements gives a rank ceil(n / d) or what is left at its end), and the owned
  // elements of a group's ranks add up to the kind's elements; without it (or with d = 1) every
  // rank holds the moments of every element.
  int64_t owned[2];
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    const int i = static_cast<int>(k);
    const parallel::ProcessGroup& g = k == ParamKind::Dense ? groups.dp_cp() : groups.expt_dp();
    const int64_t d = g.size(), numel = reg.numel(k);
    owned[i] = buckets.sharded() ? buckets.owned_numel(k) : numel;
    if (!distributed_optimizer || d == 1) {
      EXPECT_EQ(owned[i], numel) << "kind " << i;
      continue;
    }
    int64_t n_buckets = 0;
    for (const parallel::GradBucket& b : buckets.buckets()) n_buckets += b.kind == k ? 1 : 0;
    EXPECT_LT(owned[i], numel) << "kind " << i << ": not sharded over " << d << " ranks";
    EXPECT_LE(owned[i], numel / d + n_buckets) << "kind " << i;
    EXPECT_GE(owned[i] + n_buckets * (d - 1), numel / d) << "kind " << i;
    std::vector<int64_t> sum = {owned[i]};
    g.communicator().all_reduce(sum);
    EXPECT_EQ(sum[0], numel) << "kind " << i << ": owned elements over '" << g.name << "'";
  }
  const auto buffer = [](int64_t n) { return (4 * n + 63) / 64 * 64; };
  EXPECT_EQ(opt->state_bytes(MemKind::OptimizerState), 2 * (buffer(owned[0]) + buffer(owned[1])));

  // Digests: the counted parameters' (before the step's values changed: a fresh registry).
  ParamRegistry fresh(DType::F32), whole(DType::F32);
  Arena fa, wa;
  build(fresh, fa, TpShard{tp.rank, 2}, TpShard{etp.rank, 2});
  build(whole, wa, TpShard{}, TpShard{});
  const auto counted = [&buckets](const Param& p) { return buckets.counted_once(p); };
  const auto sum_over = [](uint64_t d, const parallel::ProcessGroup& g) {
    std::vector<int64_t> v{static_cast<int64_t>(d)};
    g.communicator().all_reduce(v);
    return static_cast<uint64_t>(v[0]);
  };
  EXPECT_EQ(sum_over(fresh.digest(ParamKind::Dense, counted), tp), whole.digest(ParamKind::Dense));
  EXPECT_EQ(sum_over(fresh.digest(ParamKind::Expert, counted), groups.tp_ep()),
            whole.digest(ParamKind::Expert));
  // Counting everything counts the replicated parameters twice.
  EXPECT_NE(sum_over(fresh.digest(ParamKind::Dense), tp), whole.digest(ParamKind::Dense));
}

TEST(TpGrads, PartialGradientsSummedAndTheNormCountsEachElementOnce) { run_case(false); }

TEST(TpGrads, DistributedOptimizerNormCountsEachElementOnce) { run_case(true); }

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing::run_mpi_tests(argc, argv, &moecore::g_rt);
}
