// The MoE layer under tensor, sequence and expert-tensor parallelism with Parallel Folding, under
// mpirun (4 or 8 ranks, oversubscribed): router + dispatcher + experts on this rank's sequence
// slice of its data-parallel replica's micro-batch (n / TP tokens when attention TP > 1), with
// expert fc1 / fc2 split over expert TP and the experts over EP, both dispatchers, dropless and
// padded to capacity. Against the one-rank layer with the same global weights on each replica's
// whole micro-batch:
// - outputs and input gradients of this rank's tokens;
// - every parameter gradient: each rank's local gradient scattered into the global tensor by
//   param_global_index and summed over all ranks (ReplicatedPartialGrad parts over TP / ETP,
//   expert replicas over EDP, replicas over DP) equals the one-rank gradients summed over the
//   replicas;
// - the aux, seq-aux and z-loss values (reduced over TP x CP) equal the one-rank layer's.
// Layouts, 4 ranks: TP 2 with ETP 2 EP 1 and ETP 2 EP 2; TP 1 with ETP 2 EP 2 (DP 4);
// TP 2 with ETP 1 EP 2. 8 ranks, the folded layouts: TP 2 DP 4 with EP 4 ETP 1 EDP 2;
// TP 2 with EP 8; TP 2 with EP 2 ETP 2 EDP 2; TP 4 with EP 8.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "common/mpi_testing.h"
#include "model/gpt_model.h"
#include "moe/moe_layer.h"
#include "parallel/process_groups.h"

namespace moecore::moe {

using testing::host;
namespace {

using parallel::Communicator;
using parallel::GroupKind;
using parallel::ParallelConfig;
using parallel::ProcessGroups;
using testing::all_close;

parallel::Runtime g_rt;
std::vector<ProcessGroups*> g_layouts;

constexpr int64_t kB = 2;  // sequences per micro-batch
constexpr int64_t kS = 4;  // sequence length: divisible by TP 4
constexpr int64_t kN = kB * kS;

ModelConfig layer_config(DispatcherType type, bool pad, bool gelu_bias, bool seq_aux) {
  ModelConfig cfg;
  cfg.hidden = 6;
  cfg.seq_length = kS;
  cfg.num_experts = 8;
  cfg.moe.router.num_experts = 8;
  cfg.moe.router.topk = 2;
  cfg.moe.router.load_balancing = seq_aux ? LoadBalancing::SeqAuxLoss : LoadBalancing::AuxLoss;
  cfg.moe.router.aux_loss_coeff = 0.3;
  cfg.moe.router.z_loss_coeff = 0.2;
  if (pad) {
    // No drops on any slice (capacity >= every expert's rows), so the layouts agree; every
    // expert block padded to the static capacity.
    cfg.moe.router.capacity_factor = 8.0;
    cfg.moe.router.pad_to_capacity = true;
  }
  if (gelu_bias) {
    cfg.activation = ops::Activation::GeLU;
    cfg.add_mlp_bias = true;
  }
  cfg.moe.ffn_hidden = 4;  // F / ETP = 2
  cfg.moe.dispatcher_type = type;
  cfg.init_std = 0.4;
  return cfg;
}

std::vector<double> inputs(int replica, int64_t n, uint32_t salt) {
  return testing::random_vec<double>(n, 300 + 31 * replica + salt);
}

struct LayerRun {
  std::vector<double> y, dx;
  ParamRegistry params{DType::F64};
  Arena arena;
  std::unique_ptr<MoELayer<double>> layer;
};

// Biases (zeros at init) set from their global index: the same values in every layout.
void set_biases(LayerRun& run) {
  for (Param& p : run.params.params()) {
    if (!p.name().ends_with(".bias")) continue;
    for (int64_t i = 0; i < p.local_numel(); ++i) {
      host(p.data_as<double>())[i] =
          0.2 * std::sin(0.7 * static_cast<double>(param_global_index(p, i)));
    }
  }
}

void run_layer(LayerRun& run, const ModelConfig& cfg, const ProcessGroups* groups,
               const double* x, const double* dy, int64_t n_tok) {
  run.layer = std::make_unique<MoELayer<double>>(cfg.moe_layer(), run.params,
                                                 "decoder.layers.0.mlp", groups);
  testing::plan_layer(run.arena, run.params, 7, [&](Arena& a) { run.layer->allocate(a, n_tok); });
  set_biases(run);
  run.params.zero_grads();
  run.y.assign(n_tok * cfg.hidden, 0);
  run.dx.assign(n_tok * cfg.hidden, 0);
  run.layer->forward(run.y.data(), x, n_tok);
  run.layer->backward(run.dx.data(), dy, 1.0);
}

int64_t global_numel(const Param& p) {
  int64_t n = 1;
  for (int64_t d : p.spec.global_shape) n *= d;
  return n;
}

std::string layout_name(const ProcessGroups& g) {
  const auto& d = g.degrees();
  return "TP " + std::to_string(d.tp) + " DP " + std::to_string(d.dp) + " | ETP " +
         std::to_string(d.etp) + " EP " + std::to_string(d.ep) + " EDP " + std::to_string(d.edp);
}

void check_layout(ProcessGroups* g, DispatcherType type, bool pad, bool gelu_bias, bool seq_aux) {
  const auto& deg = g->degrees();
  const int tp = deg.tp, dp = deg.dp;
  const int tp_rank = g->group(GroupKind::Tp).communicator().rank();
  const int replica = g->group(GroupKind::Dp).communicator().rank();
  Communicator& world = g->world().communicator();
  SCOPED_TRACE(::testing::Message() << layout_name(*g) << " " << dispatcher_type_name(type)
                                    << (pad ? " padded" : " dropless")
                                    << (gelu_bias ? " gelu+bias" : " swiglu")
                                    << (seq_aux ? " seq_aux" : " aux"));
  const ModelConfig cfg = layer_config(type, pad, gelu_bias, seq_aux);
  const int64_t H = cfg.hidden, n = kN / tp, first = tp_rank * n;

  // This rank: its TP slice of its replica's micro-batch.
  const std::vector<double> X = inputs(replica, kN * H, 1), DY = inputs(replica, kN * H, 2);
  LayerRun par;
  run_layer(par, cfg, g, X.data() + first * H, DY.data() + first * H, n);

  // One rank, per replica; gradients summed over the replicas.
  std::unique_ptr<LayerRun> mine;
  std::vector<std::vector<double>> ref_grads;
  for (int d = 0; d < dp; ++d) {
    const std::vector<double> Xd = inputs(d, kN * H, 1), DYd = inputs(d, kN * H, 2);
    auto one = std::make_unique<LayerRun>();
    run_layer(*one, cfg, nullptr, Xd.data(), DYd.data(), kN);
    auto& ps = one->params.params();
    if (ref_grads.empty()) ref_grads.resize(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      const double* gr = host(ps[i].grad_as<double>());
      ref_grads[i].resize(ps[i].local_numel(), 0.0);
      for (int64_t j = 0; j < ps[i].local_numel(); ++j) ref_grads[i][j] += gr[j];
    }
    if (d == replica) mine = std::move(one);
  }

  EXPECT_EQ(par.layer->router().dropped(), 0);
  EXPECT_EQ(mine->layer->router().dropped(), 0);
  if (pad) {
    EXPECT_GT(par.layer->plan().rows_per_expert, 0);
  }
  const std::vector<double> y_ref(mine->y.begin() + first * H, mine->y.begin() + (first + n) * H);
  const std::vector<double> dx_ref(mine->dx.begin() + first * H,
                                   mine->dx.begin() + (first + n) * H);
  EXPECT_TRUE(all_close(par.y, y_ref, testing::kF64Rtol, testing::kF64Atol)) << "output";
  EXPECT_TRUE(all_close(par.dx, dx_ref, testing::kF64Rtol, testing::kF64Atol)) << "input grad";
  const Router<double>& rp = par.layer->router();
  const Router<double>& ro = mine->layer->router();
  EXPECT_NEAR(rp.aux_loss(), ro.aux_loss(), 1e-12 * std::abs(ro.aux_loss())) << "aux loss";
  EXPECT_NEAR(rp.z_loss(), ro.z_loss(), 1e-12 * std::abs(ro.z_loss())) << "z loss";
  EXPECT_GT(ro.aux_loss(), 0.0);

  // Every gradient, gathered into its global tensor.
  auto& ps = par.params.params();
  ASSERT_EQ(ps.size(), ref_grads.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const Param& p = ps[i];
    std::vector<double> global(global_numel(p), 0.0);
    const double* gr = host(p.grad_as<double>());
    for (int64_t j = 0; j < p.local_numel(); ++j) global[param_global_index(p, j)] += gr[j];
    world.all_reduce(global);
    EXPECT_EQ(mine->params.params()[i].name(), p.name());
    EXPECT_TRUE(all_close(global, ref_grads[i], testing::kF64Rtol, testing::kF64Atol))
        << p.name() << " grad";
  }
  // The expert weights are split over ETP as planned.
  const Param& fc1 = par.layer->experts().fc1();
  EXPECT_EQ(fc1.local_numel(), global_numel(fc1) / (deg.ep * deg.etp));
}

TEST(EtpMoELayerMpi, EqualsOneRankLayerPerReplica) {
  for (ProcessGroups* g : g_layouts)
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather})
      for (bool pad : {false, true}) check_layout(g, type, pad, /*gelu_bias=*/false, pad);
}

// GeLU with MLP biases: fc1's bias split over ETP, fc2's replicated and added once.
TEST(EtpMoELayerMpi, BiasesEqualOneRankLayerPerReplica) {
  for (ProcessGroups* g : g_layouts)
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather})
      check_layout(g, type, /*pad=*/false, /*gelu_bias=*/true, /*seq_aux=*/false);
}

// quantile_balancing's estimate would need the TP x CP group's logits: refused under TP.
TEST(EtpMoELayerMpi, QuantileBalancingWithTensorParallelismIsRefused) {
  for (ProcessGroups* g : g_layouts) {
    ModelConfig cfg = layer_config(DispatcherType::AlltoAll, false, false, false);
    cfg.moe.router.load_balancing = LoadBalancing::QuantileBalancing;
    cfg.moe.router.aux_loss_coeff = 0.0;
    ParamRegistry params(DType::F64);
    auto build = [&] { MoELayer<double>(cfg.moe_layer(), params, "decoder.layers.0.mlp", g); };
    if (g->degrees().tp == 1) continue;
    try {
      build();
      ADD_FAILURE() << "quantile_balancing accepted at TP " << g->degrees().tp;
    } catch (const Error& e) {
      const std::string what = e.what();
      for (const std::string& part : {std::string("[moe]"), std::string("quantile_balancing"),
                                      "--tensor-model-parallel-size " +
                                          std::to_string(g->degrees().tp)}) {
        EXPECT_NE(what.find(part), std::string::npos) << what;
      }
    }
  }
}

}  // namespace
}  // namespace moecore::moe

int main(int argc, char** argv) {
  using namespace moecore;
  using namespace moecore::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  moe::g_rt = runtime_init(&argc, &argv);
  moecore::testing::quiet_gtest_on_other_ranks(moe::g_rt.rank);
  struct Grid {
    int tp, etp, ep;
  };
  std::vector<Grid> grids;
  if (moe::g_rt.world_size == 8) {
    grids = {{2, 1, 4}, {2, 1, 8}, {2, 2, 2}, {4, 1, 8}};
  } else {
    grids = {{2, 2, 1}, {2, 2, 2}, {1, 2, 2}, {2, 1, 2}};
  }
  int rc = 0;
  {
    std::vector<std::unique_ptr<ProcessGroups>> owned;
    for (const Grid& gr : grids) {
      ParallelConfig c;
      c.tp = gr.tp;
      c.etp = gr.etp;
      c.ep = gr.ep;
      c.sequence_parallel = gr.tp > 1;
      c.timeout_minutes = 1.0;  // a deadlock ends with a diagnostic
      owned.push_back(
          std::make_unique<ProcessGroups>(make_layout(c, moe::g_rt.world_size), moe::g_rt.rank));
      connect_communicators(*owned.back());
      moe::g_layouts.push_back(owned.back().get());
    }
    rc = RUN_ALL_TESTS();
    rc = moecore::testing::any_rank_failed(rc, owned.front()->world().communicator());
    rc = moecore::testing::report_skips(rc, moe::g_rt.rank, moe::g_rt.world_size);
    moe::g_layouts.clear();
  }
  runtime_finalize();
  return rc;
}
