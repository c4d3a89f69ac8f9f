// Expert parallelism under mpirun (4 ranks, oversubscribed): EP = 2 (two EP groups of two) and
// EP = 4, both dispatchers; and the alltoall dispatcher at expert TP 2 x EP 2 in its dropless
// worst case (the receive buffers planned for one ETP slice, filled to the last row).
// - Routing proof: each rank fills its tokens with its EP rank and token index; the experts'
//   rows must be exactly the routed (source rank, token, slot) triples in (expert, source rank,
//   token) order, every output row must come back to its source token, and the prob gradient to
//   its source slot. Uneven token counts (one rank has none; padded all-gather: the same count
//   on every rank of a group, which it does not exchange), dropped slots, an expert no rank
//   routes to, every token to one expert, padding to capacity.
// - allgather == alltoall: MoE layer outputs, input grads, router and expert weight grads
//   (bitwise for top-k <= 2, within the f64 tolerance for top-k 3).
// - The EP-sharded MoE layer equals the single-rank layer: dropless on all ranks' tokens
//   concatenated (loss summed; also with the gated shared expert), and with capacity dropping /
//   padding (capacity is per rank, as in Megatron) against each rank's own single-rank layer
//   with expert grads summed over EP.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "common/layer_testing.h"
#include "common/mpi_testing.h"
#include "common/tiny_model_config.h"
#include "model/gpt_model.h"
#include "moe/allgather_dispatcher.h"
#include "moe/alltoall_dispatcher.h"
#include "moe/moe_layer.h"
#include "ops/gemm_bf16.h"
#include "parallel/process_groups.h"

namespace moecore::moe {

using testing::host;
namespace {

using parallel::Communicator;
using parallel::ProcessGroups;
using testing::all_close;
using testing::rel_distance;

parallel::Runtime g_rt;
ProcessGroups* g_ep2 = nullptr;  // EP = 2 (EDP = 2)
ProcessGroups* g_ep4 = nullptr;  // EP = 4
ProcessGroups* g_etp2 = nullptr;  // expert TP 2 x EP 2 (EDP = 1)

std::vector<ProcessGroups*> layouts() { return {g_ep2, g_ep4}; }
Communicator& ep_comm(ProcessGroups* g) { return g->ep().communicator(); }

// ---- routing patterns, reproducible on every rank for every source rank ----

enum class Pattern { Random, AllToOne };

struct Routing {
  int64_t n_tok = 0;
  std::vector<int32_t> idx;  // [T, K], -1 = dropped
};

// Random distinct experts per token, never expert E-1 (no rank routes to it), and with
// `drops` some slots dropped. AllToOne: slot 0 of every token picks expert E/2 + 1.
Routing make_routing(Pattern pat, int src, int64_t n_tok, int64_t K, int64_t E, bool drops) {
  Routing r{n_tok, std::vector<int32_t>(n_tok * K)};
  std::mt19937 gen(1234 + 17 * src + 5 * K);
  for (int64_t t = 0; t < n_tok; ++t) {
    std::vector<int32_t> pool;
    for (int32_t e = 0; e < E - 1; ++e) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), gen);
    if (pat == Pattern::AllToOne) {
      const int32_t one = static_cast<int32_t>(E / 2 + 1);
      std::erase(pool, one);
      pool.insert(pool.begin(), one);
    }
    for (int64_t k = 0; k < K; ++k) {
      r.idx[t * K + k] = pool[k];
      if (drops && (t * 3 + k + src) % 5 == 0) r.idx[t * K + k] = -1;
    }
  }
  return r;
}

// Token counts per EP rank: uneven, one rank with none.
int64_t tokens_of(int ep_rank) { return std::vector<int64_t>{5, 0, 7, 3}[ep_rank % 4]; }

double xval(int src, int64_t t, int64_t h) { return src * 1000 + t * 10 + h; }
double pval(int src, int64_t t, int64_t k) { return src * 1000 + t * 10 + k + 0.5; }

std::unique_ptr<TokenDispatcher<double>> make(DispatcherType type, int64_t E, int64_t K,
                                              int64_t H, double pad_cf, Communicator& c) {
  if (type == DispatcherType::AllGather)
    return std::make_unique<AllGatherDispatcher<double>>(E, K, H, EpRowBudget{pad_cf}, c);
  return std::make_unique<AlltoAllDispatcher<double>>(E, K, H, EpRowBudget{pad_cf}, c);
}

struct RouteCase {
  Pattern pat;
  int64_t K;
  bool drops;
  bool pad;
};

// Dispatch, identity "experts", combine and both backwards on rank-id data: exact equality.
void check_routing(ProcessGroups* g, DispatcherType type, RouteCase rc) {
  Communicator& c = ep_comm(g);
  const int me = c.rank(), R = c.size();
  const int64_t E = 8, K = rc.K, H = 3, L = E / R, max_tok = 8;
  std::vector<Routing> all;
  // Padded, the all-gather dispatcher takes every rank's tokens to be its own count (the same
  // micro-batch shape everywhere: nothing is exchanged); the all-to-all one needs only the same
  // capacity, so it keeps the uneven counts.
  const bool same_tokens = rc.pad && type == DispatcherType::AllGather;
  for (int s = 0; s < R; ++s)
    all.push_back(make_routing(rc.pat, s, tokens_of(same_tokens ? 0 : s), K, E, rc.drops));
  const Routing& mine = all[me];
  // Padding: one capacity for every rank, at least the fullest (expert, rank) chunk.
  int64_t cap = 0;
  if (rc.pad) {
    for (const Routing& r : all)
      for (int64_t e = 0; e < E; ++e) cap = std::max<int64_t>(cap, std::count(r.idx.begin(), r.idx.end(), e));
    cap += 1;  // at least one pad row everywhere
  }
  auto d = make(type, E, K, H, rc.pad ? 8.0 : 0.0, c);
  Arena arena;
  arena.plan([&](Arena& a) { d->allocate(a, max_tok); });
  const auto calls_before = c.calls();
  const DispatchPlan& p = d->plan(mine.idx.data(), mine.n_tok, cap);
  if (type == DispatcherType::AllGather) {
    // The routing map's all-gather, after the token counts' exchange when dropless; padded,
    // every rank's counts are known and nothing else is exchanged.
    EXPECT_EQ((c.calls() - calls_before).all_gather, rc.pad ? 1 : 2) << "the plan's all-gathers";
  }

  // Expected expert rows: (expert, source rank, token), pad rows after each source's chunk.
  struct Row { int src; int64_t t, k; };
  std::vector<Row> rows;
  std::vector<int64_t> per_expert(L, 0);
  for (int64_t l = 0; l < L; ++l) {
    for (int s = 0; s < R; ++s) {
      int64_t n = 0;
      for (int64_t t = 0; t < all[s].n_tok; ++t)
        for (int64_t k = 0; k < K; ++k)
          if (all[s].idx[t * K + k] == me * L + l) rows.push_back({s, t, k}), ++n;
      for (; rc.pad && n < cap; ++n) rows.push_back({-1, -1, -1});
      per_expert[l] += rc.pad ? cap : n;
    }
  }
  ASSERT_EQ(p.n_rows, static_cast<int64_t>(rows.size()));
  ASSERT_EQ(std::vector<int64_t>(host(p.tokens_per_expert_L), host(p.tokens_per_expert_L) + L),
            per_expert);
  EXPECT_EQ(p.ep_size, R);
  if (rc.pad) {
    EXPECT_EQ(p.rows_per_expert, R * cap);
  }

  const int64_t T = mine.n_tok, N = p.n_rows;
  std::vector<double> x(T * H), probs(T * K);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) x[t * H + h] = xval(me, t, h);
    for (int64_t k = 0; k < K; ++k) probs[t * K + k] = pval(me, t, k);
  }
  testing::Guarded<double> x_NH(N * H, -7), p_N(N, -7);
  d->dispatch(x_NH.data(), p_N.data(), x.data(), probs.data());
  EXPECT_TRUE(x_NH.intact() && p_N.intact());
  for (int64_t r = 0; r < N; ++r) {
    const Row& w = rows[r];
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(x_NH[r * H + h], w.src < 0 ? 0.0 : xval(w.src, w.t, h))
          << "row " << r << " of EP rank " << me << " (source " << w.src << ", token " << w.t << ")";
    ASSERT_EQ(p_N[r], w.src < 0 ? 0.0 : pval(w.src, w.t, w.k)) << "prob of row " << r;
  }
  // Identity experts: every token comes back times its kept slots.
  std::vector<double> kept(T, 0);
  for (int64_t i = 0; i < T * K; ++i) kept[i / K] += mine.idx[i] >= 0;
  testing::Guarded<double> y(T * H, -7), dy_NH(N * H, -7), dx(T * H, -7), dprobs(T * K, -7);
  d->combine(y.data(), x_NH.data());
  d->combine_backward(dy_NH.data(), x.data());
  d->dispatch_backward(dx.data(), dprobs.data(), x_NH.data(), p_N.data());
  EXPECT_TRUE(y.intact() && dy_NH.intact() && dx.intact() && dprobs.intact());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      ASSERT_EQ(y[t * H + h], kept[t] * xval(me, t, h)) << "combine, token " << t;
      ASSERT_EQ(dx[t * H + h], kept[t] * xval(me, t, h)) << "dispatch_backward, token " << t;
    }
  for (int64_t r = 0; r < N * H; ++r) ASSERT_EQ(dy_NH[r], x_NH[r]) << "combine_backward";
  for (int64_t i = 0; i < T * K; ++i)
    ASSERT_EQ(dprobs[i], mine.idx[i] >= 0 ? probs[i] : 0.0) << "prob grad of slot " << i;
}

TEST(EpDispatcherMpi, EveryTokenReturnsToItsSourceRow) {
  for (ProcessGroups* g : layouts())
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather})
      for (RouteCase rc : {RouteCase{Pattern::Random, 1, false, false},
                           RouteCase{Pattern::Random, 2, true, false},
                           RouteCase{Pattern::Random, 3, false, false},
                           RouteCase{Pattern::AllToOne, 1, false, false},
                           RouteCase{Pattern::AllToOne, 2, true, false},
                           RouteCase{Pattern::Random, 2, true, true},
                           RouteCase{Pattern::AllToOne, 1, false, true}}) {
        SCOPED_TRACE(::testing::Message() << "EP=" << g->degrees().ep << " " << dispatcher_type_name(type)
                     << " K=" << rc.K << " pattern=" << int(rc.pat) << " drops=" << rc.drops
                     << " pad=" << rc.pad);
        check_routing(g, type, rc);
      }
}

// Expert TP 2 x EP 2, dropless, in its worst case: every token of every rank (each at the
// planned maximum T) routed to EP rank 0's experts (slot k to expert k), so EP rank 0 receives
// exactly the planned N = ETP x EP x T x K rows, and each of its ETP ranks' all-to-all exactly
// N / ETP: its receive buffers (planned for one ETP slice) full to the last row. The rows arrive
// in [local expert][etp][ep][token] order, each from its source; with identity experts on both
// ETP ranks every token comes back summed over them (ETP x its K copies), and so do the input
// and prob gradients.
TEST(EpDispatcherMpi, EtpWorstCaseFillsTheReceiveSliceExactly) {
  if (g_etp2 == nullptr) GTEST_SKIP() << "needs 4 ranks";
  Communicator& ep = g_etp2->ep().communicator();
  Communicator& etp = g_etp2->expt_tp().communicator();
  const int R = ep.size(), P = etp.size(), r = ep.rank(), pe = etp.rank();
  ASSERT_EQ(R, 2);
  ASSERT_EQ(P, 2);
  const int64_t E = 8, K = 2, H = 3, T = 6;
  const int me = pe * R + r;  // a source id, unique over the ETP x EP group
  AlltoAllDispatcher<double> d(E, K, H, EpRowBudget{}, ep, &etp);
  Arena arena;
  arena.plan([&](Arena& a) { d.allocate(a, T); });
  const int64_t planned = d.max_rows(T);
  ASSERT_EQ(planned, P * R * T * K);
  ASSERT_EQ(d.recv_max_rows(T), planned / P);
  std::vector<int32_t> idx(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) idx[t * K + k] = static_cast<int32_t>(k);
  const DispatchPlan& p = d.plan(idx.data(), T);
  const int64_t N = p.n_rows;
  ASSERT_EQ(N, r == 0 ? planned : 0);
  int64_t received = 0;
  for (int s = 0; s < R; ++s) received += p.recv_rows_R[s];
  EXPECT_EQ(received, r == 0 ? planned / P : 0) << "this ETP rank's all-to-all";

  std::vector<double> x(T * H), probs(T * K);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) x[t * H + h] = xval(me, t, h);
    for (int64_t k = 0; k < K; ++k) probs[t * K + k] = pval(me, t, k);
  }
  testing::Guarded<double> x_NH(N * H, -7), p_N(N, -7);
  d.dispatch(x_NH.data(), p_N.data(), x.data(), probs.data());
  EXPECT_TRUE(x_NH.intact() && p_N.intact());
  int64_t row = 0;
  for (int64_t l = 0; l < (r == 0 ? K : 0); ++l)
    for (int sp = 0; sp < P; ++sp)
      for (int sr = 0; sr < R; ++sr)
        for (int64_t t = 0; t < T; ++t, ++row) {
          const int src = sp * R + sr;
          for (int64_t h = 0; h < H; ++h)
            ASSERT_EQ(x_NH[row * H + h], xval(src, t, h))
                << "row " << row << ": expert " << l << ", source etp " << sp << " ep " << sr;
          ASSERT_EQ(p_N[row], pval(src, t, l)) << "prob of row " << row;
        }
  ASSERT_EQ(row, N);
  testing::Guarded<double> y(T * H, -7), dy_NH(N * H, -7), dx(T * H, -7), dprobs(T * K, -7);
  d.combine(y.data(), x_NH.data());
  d.combine_backward(dy_NH.data(), x.data());
  d.dispatch_backward(dx.data(), dprobs.data(), x_NH.data(), p_N.data());
  EXPECT_TRUE(y.intact() && dy_NH.intact() && dx.intact() && dprobs.intact());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      ASSERT_EQ(y[t * H + h], P * K * xval(me, t, h)) << "combine, token " << t;
      ASSERT_EQ(dx[t * H + h], P * K * xval(me, t, h)) << "dispatch_backward, token " << t;
    }
  for (int64_t i = 0; i < N * H; ++i) ASSERT_EQ(dy_NH[i], x_NH[i]) << "combine_backward";
  for (int64_t i = 0; i < T * K; ++i) ASSERT_EQ(dprobs[i], P * probs[i]) << "prob grad " << i;
}

// ---- the MoE layer ----

ModelConfig layer_config(int64_t E, int64_t K, DispatcherType type) {
  ModelConfig cfg;
  cfg.hidden = 6;
  cfg.seq_length = 4;
  cfg.num_experts = E;
  cfg.moe.router.num_experts = E;
  cfg.moe.router.topk = K;
  cfg.moe.router.aux_loss_coeff = 0.0;
  cfg.moe.ffn_hidden = 4;
  cfg.moe.dispatcher_type = type;
  cfg.init_std = 0.4;
  return cfg;
}

struct LayerRun {
  std::vector<double> y, dx;
  ParamRegistry params{DType::F64};
  Arena arena;
  std::unique_ptr<MoELayer<double>> layer;
};

std::vector<double> inputs(int src, int64_t n, uint32_t salt) {
  return testing::random_vec<double>(n, 100 + 31 * src + salt);
}

// Forward + backward of sum(y * dy) on `x` (n_tok tokens); groups null = one rank.
// MLP biases (zeros at init) are set to a function of their global index, so that every
// layout holds the same values and they act.
void set_biases(LayerRun& run) {
  const int64_t first = run.layer->dispatcher().first_local_expert();
  for (Param& p : run.params.params()) {
    if (!p.name().ends_with("linear_fc1.bias") && !p.name().ends_with("linear_fc2.bias")) continue;
    const int64_t off = p.spec.kind == ParamKind::Expert
                            ? first * (p.local_numel() / run.layer->experts().num_local())
                            : 0;
    for (int64_t i = 0; i < p.local_numel(); ++i)
      host(p.data_as<double>())[i] = 0.2 * std::sin(0.7 * static_cast<double>(off + i));
  }
}

void run_layer(LayerRun& run, const ModelConfig& cfg, const ProcessGroups* groups,
               const std::vector<double>& x, const std::vector<double>& dy, int64_t n_tok,
               int64_t max_tokens) {
  if (!run.layer) {
    run.layer = std::make_unique<MoELayer<double>>(cfg.moe_layer(), run.params, "decoder.layers.0.mlp",
                                                   groups);
    testing::plan_layer(run.arena, run.params, 7,
                        [&](Arena& a) { run.layer->allocate(a, max_tokens); });
    set_biases(run);
  }
  run.params.zero_grads();
  run.y.assign(n_tok * cfg.hidden, 0);
  run.dx.assign(n_tok * cfg.hidden, 0);
  run.layer->forward(run.y.data(), x.data(), n_tok);
  run.layer->backward(run.dx.data(), dy.data(), 1.0);
}

std::vector<double> grad(const Param& p) {
  return std::vector<double>(host(p.grad_as<double>()),
                             host(p.grad_as<double>()) + p.local_numel());
}
std::vector<double> slice(const Param& p, int64_t first, int64_t n) {
  const double* g = host(p.grad_as<double>());
  return std::vector<double>(g + first, g + first + n);
}

// The layer both dispatcher tests compare: 8 experts, top-k K, aux and z losses, a shared
// expert, capacity factor cf (0: dropless).
ModelConfig dispatcher_config(int64_t K, double cf, DispatcherType type) {
  ModelConfig cfg = layer_config(8, K, type);
  cfg.moe.router.pre_softmax = K == 1;  // softmax top-1 needs it
  cfg.moe.router.aux_loss_coeff = 0.02;
  cfg.moe.router.z_loss_coeff = 0.01;
  cfg.moe.router.capacity_factor = cf;
  cfg.moe.shared_ffn_hidden = 3;
  return cfg;
}

TEST(EpMoELayerMpi, AllGatherEqualsAlltoAll) {
  for (ProcessGroups* g : layouts()) {
    const int me = ep_comm(g).rank();
    SCOPED_TRACE(::testing::Message() << "EP=" << g->degrees().ep);
    const ModelConfig a2a = dispatcher_config(3, 0.0, DispatcherType::AlltoAll);
    const ModelConfig ag = dispatcher_config(3, 0.0, DispatcherType::AllGather);
    const int64_t n = 5 + me, H = a2a.hidden;
    auto x = inputs(me, n * H, 1), dy = inputs(me, n * H, 2);
    LayerRun ra, rg;
    run_layer(ra, a2a, g, x, dy, n, 8);
    run_layer(rg, ag, g, x, dy, n, 8);
    EXPECT_TRUE(all_close(rg.y, ra.y, testing::kF64Rtol, testing::kF64Atol)) << "output";
    EXPECT_TRUE(all_close(rg.dx, ra.dx, testing::kF64Rtol, testing::kF64Atol)) << "input grad";
    for (size_t i = 0; i < ra.params.params().size(); ++i) {
      const Param& pa = ra.params.params()[i];
      EXPECT_TRUE(all_close(grad(rg.params.params()[i]), grad(pa), testing::kF64Rtol, testing::kF64Atol))
          << pa.name();
    }
    // Determinism: the same step again is bitwise the same.
    std::vector<double> y0 = ra.y, dx0 = ra.dx, g0 = grad(ra.layer->experts().fc1());
    run_layer(ra, a2a, g, x, dy, n, 8);
    EXPECT_EQ(ra.y, y0);
    EXPECT_EQ(ra.dx, dx0);
    EXPECT_EQ(grad(ra.layer->experts().fc1()), g0);
  }
}

// With top-k <= 2 the two dispatchers agree bitwise (docs/parallel.md): a token's combine is
// the sum of at most two copies (a + b == b + a; the allgather's other terms are exact zeros),
// the experts see identical rows in the same order, and so every gradient is the same too.
// Aux and z losses, a shared expert, capacity dropping on and off.
TEST(EpMoELayerMpi, AllGatherEqualsAlltoAllBitwiseForTopkUpToTwo) {
  for (ProcessGroups* g : layouts()) {
    const int me = ep_comm(g).rank();
    for (int64_t K : {1, 2}) {
      for (double cf : {0.0, 1.0}) {
        SCOPED_TRACE(::testing::Message() << "EP=" << g->degrees().ep << " K=" << K << " cf=" << cf);
        const ModelConfig a2a = dispatcher_config(K, cf, DispatcherType::AlltoAll);
        const ModelConfig ag = dispatcher_config(K, cf, DispatcherType::AllGather);
        const int64_t n = 5 + me, H = a2a.hidden;
        auto x = inputs(me, n * H, 1), dy = inputs(me, n * H, 2);
        LayerRun ra, rg;
        run_layer(ra, a2a, g, x, dy, n, 8);
        run_layer(rg, ag, g, x, dy, n, 8);
        EXPECT_EQ(rg.y, ra.y) << "output";
        EXPECT_EQ(rg.dx, ra.dx) << "input grad";
        for (size_t i = 0; i < ra.params.params().size(); ++i) {
          EXPECT_EQ(grad(rg.params.params()[i]), grad(ra.params.params()[i]))
              << ra.params.params()[i].name();
        }
      }
    }
  }
}

// Dropless: the EP layer on each rank's tokens == the one-rank layer on all EP ranks' tokens
// concatenated in EP-rank order, with the loss summed over ranks.
TEST(EpMoELayerMpi, EqualsSingleRankLayerOnConcatenatedTokens) {
  for (ProcessGroups* g : layouts())
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather}) {
      Communicator& c = ep_comm(g);
      const int me = c.rank(), R = c.size();
      SCOPED_TRACE(::testing::Message() << "EP=" << R << " " << dispatcher_type_name(type));
      const ModelConfig cfg = layer_config(8, 2, type);
      const int64_t H = cfg.hidden, max_tok = 8;
      std::vector<double> X, DY;
      int64_t total = 0, my_off = 0;
      for (int s = 0; s < R; ++s) {
        const int64_t n = 4 + s;  // uneven, not divisible by EP
        auto xs = inputs(s, n * H, 1), dys = inputs(s, n * H, 2);
        if (s == me) my_off = total;
        X.insert(X.end(), xs.begin(), xs.end());
        DY.insert(DY.end(), dys.begin(), dys.end());
        total += n;
      }
      const int64_t n = 4 + me;
      std::vector<double> x(X.begin() + my_off * H, X.begin() + (my_off + n) * H);
      std::vector<double> dy(DY.begin() + my_off * H, DY.begin() + (my_off + n) * H);
      LayerRun ep, one;
      run_layer(ep, cfg, g, x, dy, n, max_tok);
      run_layer(one, cfg, nullptr, X, DY, total, total);
      const std::vector<double> y_ref(one.y.begin() + my_off * H, one.y.begin() + (my_off + n) * H);
      const std::vector<double> dx_ref(one.dx.begin() + my_off * H, one.dx.begin() + (my_off + n) * H);
      EXPECT_TRUE(all_close(ep.y, y_ref, testing::kF64Rtol, testing::kF64Atol)) << "output";
      EXPECT_TRUE(all_close(ep.dx, dx_ref, testing::kF64Rtol, testing::kF64Atol)) << "input grad";
      // The router is replicated over EP (each rank its own tokens): its grads sum over EP.
      std::vector<double> gr = grad(ep.layer->router().weight());
      c.all_reduce(gr);
      EXPECT_TRUE(all_close(gr, grad(one.layer->router().weight()), testing::kF64Rtol, testing::kF64Atol))
          << "router grad";
      const int64_t first = ep.layer->dispatcher().first_local_expert();
      EXPECT_EQ(first, me * (8 / R));
      for (auto pick : {&GroupedExperts<double>::fc1, &GroupedExperts<double>::fc2}) {
        const Param& pe = (ep.layer->experts().*pick)();
        const Param& po = (one.layer->experts().*pick)();
        const int64_t per = pe.local_numel() / ep.layer->experts().num_local();
        // The local slice was initialised from the global index: same values as the 1-rank ones.
        EXPECT_EQ(std::vector<double>(host(pe.data_as<double>()),
                                      host(pe.data_as<double>()) + pe.local_numel()),
                  std::vector<double>(host(po.data_as<double>()) + first * per,
                                      host(po.data_as<double>()) + first * per + pe.local_numel()))
            << pe.name() << " values";
        EXPECT_TRUE(all_close(grad(pe), slice(po, first * per, pe.local_numel()), testing::kF64Rtol,
                              testing::kF64Atol))
            << pe.name() << " grad";
      }
    }
}

// The gated shared expert (--moe-shared-expert-gate) under EP: it is dense and replicated like
// the router, so on each rank's tokens the layer equals the one-rank layer on all EP ranks'
// tokens concatenated, and its gradients (fc1, fc2, gate_weight) summed over EP equal the
// one-rank ones, as the router's do; the expert slices as in the ungated case.
// The same for GeLU with MLP biases (no gate): the expert biases [E, F] and [E, H] are sliced
// over EP like the weights, the shared expert's biases are dense.
TEST(EpMoELayerMpi, SharedExpertGateEqualsSingleRankLayerOnConcatenatedTokens) {
  for (ProcessGroups* g : layouts())
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather})
      for (bool gelu_bias : {false, true}) {
        Communicator& c = ep_comm(g);
        const int me = c.rank(), R = c.size();
        SCOPED_TRACE(::testing::Message() << "EP=" << R << " " << dispatcher_type_name(type)
                                          << (gelu_bias ? " gelu+bias" : " gate"));
        ModelConfig cfg = layer_config(8, 2, type);
        cfg.moe.shared_ffn_hidden = 3;
        // No aux loss: it is per rank, not on the concatenation.
        cfg.moe.shared_expert_gate = !gelu_bias;
        if (gelu_bias) {
          cfg.activation = ops::Activation::GeLU;
          cfg.add_mlp_bias = true;
        }
        const int64_t H = cfg.hidden, max_tok = 3 + 2 * (R - 1);
        std::vector<double> X, DY;
        int64_t total = 0, my_off = 0;
        for (int s = 0; s < R; ++s) {
          const int64_t n = 3 + 2 * s;  // uneven, not divisible by EP
          auto xs = inputs(s, n * H, 5), dys = inputs(s, n * H, 6);
          if (s == me) my_off = total;
          X.insert(X.end(), xs.begin(), xs.end());
          DY.insert(DY.end(), dys.begin(), dys.end());
          total += n;
        }
        const int64_t n = 3 + 2 * me;
        std::vector<double> x(X.begin() + my_off * H, X.begin() + (my_off + n) * H);
        std::vector<double> dy(DY.begin() + my_off * H, DY.begin() + (my_off + n) * H);
        LayerRun ep, one;
        run_layer(ep, cfg, g, x, dy, n, max_tok);
        run_layer(one, cfg, nullptr, X, DY, total, total);
        EXPECT_EQ(ep.params.find("decoder.layers.0.mlp.shared_experts.gate_weight") != nullptr,
                  !gelu_bias);
        EXPECT_EQ(ep.params.find("decoder.layers.0.mlp.experts.linear_fc2.bias") != nullptr,
                  gelu_bias);
        const std::vector<double> y_ref(one.y.begin() + my_off * H,
                                        one.y.begin() + (my_off + n) * H);
        const std::vector<double> dx_ref(one.dx.begin() + my_off * H,
                                         one.dx.begin() + (my_off + n) * H);
        EXPECT_TRUE(all_close(ep.y, y_ref, testing::kF64Rtol, testing::kF64Atol)) << "output";
        EXPECT_TRUE(all_close(ep.dx, dx_ref, testing::kF64Rtol, testing::kF64Atol)) << "input grad";
        const int64_t first = ep.layer->dispatcher().first_local_expert();
        for (const Param& pe : ep.params.params()) {
          const Param& po = one.params.get(pe.name());
          if (pe.spec.kind == ParamKind::Dense) {  // router and shared expert: summed over EP
            std::vector<double> gd = grad(pe);
            c.all_reduce(gd);
            EXPECT_TRUE(all_close(gd, grad(po), testing::kF64Rtol, testing::kF64Atol)) << pe.name();
          } else {
            const int64_t per = pe.local_numel() / ep.layer->experts().num_local();
            EXPECT_TRUE(all_close(grad(pe), slice(po, first * per, pe.local_numel()),
                                  testing::kF64Rtol, testing::kF64Atol))
                << pe.name();
          }
        }
      }
}

// Capacity is per rank (Megatron: on the rank's own tokens), so the reference is each rank's
// own one-rank layer; the EP experts see every rank's kept rows, so their grads are the sum over
// EP ranks of the references'.
TEST(EpMoELayerMpi, CapacityDroppingAndPaddingEqualPerRankLayers) {
  for (ProcessGroups* g : layouts())
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather})
      for (bool pad : {false, true}) {
        Communicator& c = ep_comm(g);
        const int me = c.rank(), R = c.size();
        SCOPED_TRACE(::testing::Message() << "EP=" << R << " " << dispatcher_type_name(type) << " pad=" << pad);
        ModelConfig cfg = layer_config(8, 2, type);
        cfg.moe.router.capacity_factor = 1.0;  // capacity = ceil(8 * 2 / 8) = 2 rows per expert
        cfg.moe.router.pad_to_capacity = pad;
        cfg.moe.router.aux_loss_coeff = 0.01;
        const int64_t n = 8, H = cfg.hidden;
        auto x = inputs(me, n * H, 3), dy = inputs(me, n * H, 4);
        LayerRun ep, one;
        run_layer(ep, cfg, g, x, dy, n, n);
        run_layer(one, cfg, nullptr, x, dy, n, n);
        EXPECT_GT(ep.layer->router().dropped(), 0) << "the case must drop tokens";
        if (pad) {
          EXPECT_EQ(ep.layer->plan().rows_per_expert, R * 2);
        }
        EXPECT_TRUE(all_close(ep.y, one.y, testing::kF64Rtol, testing::kF64Atol)) << "output";
        EXPECT_TRUE(all_close(ep.dx, one.dx, testing::kF64Rtol, testing::kF64Atol)) << "input grad";
        EXPECT_TRUE(all_close(grad(ep.layer->router().weight()), grad(one.layer->router().weight()),
                              testing::kF64Rtol, testing::kF64Atol))
            << "router grad";
        const int64_t first = ep.layer->dispatcher().first_local_expert();
        for (auto pick : {&GroupedExperts<double>::fc1, &GroupedExperts<double>::fc2}) {
          const Param& pe = (ep.layer->experts().*pick)();
          std::vector<double> sum = grad((one.layer->experts().*pick)());
          c.all_reduce(sum);
          const int64_t per = pe.local_numel() / ep.layer->experts().num_local();
          EXPECT_TRUE(all_close(grad(pe),
                                std::vector<double>(sum.begin() + first * per,
                                                    sum.begin() + first * per + pe.local_numel()),
                                testing::kF64Rtol, testing::kF64Atol))
              << pe.name() << " grad";
        }
      }
}

// --moe-shared-expert-overlap: the shared expert's four pieces run while the dispatcher's
// collectives are in flight: fc1 with the dispatch, fc2 with the combine, fc2's backward with
// the combine's backward, fc1's backward with the dispatch's backward (each window counted by
// the layer from the dispatcher's pending handles: seen between the start and the wait), and
// the layer's output, input gradient and every parameter gradient are bitwise those without the
// flag. EP 2, EP 4 and ETP 2 x EP 2 (the alltoall dispatcher: the configuration refuses the
// overlap with the all-gather one, as Megatron does), dropless and padded, plain and gated
// shared expert; one rank (the local dispatcher, nothing in flight) the same, bitwise, with
// nothing counted.
TEST(EpMoELayerMpi, SharedExpertOverlapIsBitwiseAndInFlight) {
  std::vector<ProcessGroups*> all = layouts();
  if (g_etp2 != nullptr) all.push_back(g_etp2);
  all.push_back(nullptr);  // one rank
  const DispatcherType type = DispatcherType::AlltoAll;
  for (ProcessGroups* g : all)
    for (bool pad : {false, true})
      for (bool gate : {false, true}) {
        const int me = g != nullptr ? ep_comm(g).rank() : 0;
        SCOPED_TRACE(::testing::Message()
                     << (g != nullptr ? "EP=" + std::to_string(g->degrees().ep) +
                                            " ETP=" + std::to_string(g->degrees().etp)
                                      : std::string("one rank"))
                     << " " << dispatcher_type_name(type) << (pad ? " padded" : " dropless")
                     << (gate ? " gated" : ""));
        ModelConfig cfg = dispatcher_config(2, pad ? 1.0 : 0.0, type);
        cfg.moe.router.pad_to_capacity = pad;
        cfg.moe.shared_expert_gate = gate;
        const int64_t n = 5 + me, H = cfg.hidden;
        auto x = inputs(me, n * H, 7), dy = inputs(me, n * H, 8);
        LayerRun plain, overlap;
        run_layer(plain, cfg, g, x, dy, n, 8);
        cfg.moe.shared_expert_overlap = true;
        run_layer(overlap, cfg, g, x, dy, n, 8);
        EXPECT_FALSE(plain.layer->overlaps_shared_expert());
        EXPECT_TRUE(overlap.layer->overlaps_shared_expert());
        const auto& none = plain.layer->shared_expert_overlaps();
        const auto& seen = overlap.layer->shared_expert_overlaps();
        EXPECT_EQ(none.dispatch + none.combine + none.combine_backward + none.dispatch_backward,
                  0);
        const int64_t in_flight = g != nullptr ? 1 : 0;  // the local dispatcher sends nothing
        EXPECT_EQ(seen.dispatch, in_flight) << "shared fc1 during the dispatch";
        EXPECT_EQ(seen.combine, in_flight) << "shared fc2 during the combine";
        EXPECT_EQ(seen.combine_backward, in_flight) << "shared fc2 backward during the combine's";
        EXPECT_EQ(seen.dispatch_backward, in_flight)
            << "shared fc1 backward during the dispatch's";
        EXPECT_EQ(overlap.y, plain.y) << "output";
        EXPECT_EQ(overlap.dx, plain.dx) << "input grad";
        ASSERT_EQ(overlap.params.params().size(), plain.params.params().size());
        for (size_t i = 0; i < plain.params.params().size(); ++i) {
          EXPECT_EQ(grad(overlap.params.params()[i]), grad(plain.params.params()[i]))
              << plain.params.params()[i].name();
        }
      }
}

// --bf16 dispatch under EP (MoELayer::set_bf16_dispatch): the tokens, and without MLP biases the
// output gradient, move as bf16 through the permutation, the all-to-all and the ETP gather; the
// experts' outputs and input gradients come back as bf16 rows, rounded once (under ETP after the
// reduce-scatter summed the partials in f32), through the all-to-all back and the unpermutation
// (summed widened, in f32). The f32 model on bf16 weight copies (this CPU's bf16 GEMM path): every
// parameter gradient bitwise those of the f32 rows, the output and the input gradient within the
// rows' rounding (2^-8 of their norm) and not bitwise, but for the allgather dispatcher under ETP
// (its one reduce-scatter sums the partials: no rounding, bitwise); the all-to-all sends exactly
// 2 H bytes less per row leaving this rank in the dispatch and, without biases, in the combine's
// backward, and per row going back in the combine and the dispatch's backward. EP 2, EP 4, ETP 2
// x EP 2, both dispatchers, dropless and padded, with and without biases.
struct Bf16Run {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;
  int64_t a2a_bytes = 0;  // this rank's all-to-all bytes of the forward and backward
  int64_t rows_left = 0;  // rows the dispatch sent to other EP ranks
  int64_t rows_came = 0;  // rows the dispatch received from other EP ranks (they go back)
};

Bf16Run run_bf16_layer(const ModelConfig& cfg, ProcessGroups* g, bool bf16_dispatch, int me) {
  ParamRegistry params(DType::F32);
  params.enable_bf16_copies(ops::bf16_gemm_path() == ops::Bf16GemmPath::Widen);
  MoELayer<float> layer(cfg.moe_layer(), params, "decoder.layers.0.mlp", g);
  layer.set_bf16_dispatch(bf16_dispatch);
  Arena arena;
  testing::plan_layer(arena, params, 7, [&](Arena& a) { layer.allocate(a, 8); });
  const int64_t first = layer.dispatcher().first_local_expert();
  for (Param& p : params.params()) {
    if (!p.name().ends_with(".bias")) continue;
    const int64_t off = p.spec.kind == ParamKind::Expert
                            ? first * (p.local_numel() / layer.experts().num_local())
                            : 0;
    for (int64_t i = 0; i < p.local_numel(); ++i)
      host(p.data_as<float>())[i] = 0.2f * std::sin(0.7f * static_cast<float>(off + i));
  }
  params.refresh_bf16();
  EXPECT_EQ(layer.bf16_rows(), bf16_dispatch);
  EXPECT_EQ(layer.bf16_dy_rows(), bf16_dispatch && !cfg.add_mlp_bias);
  // Uneven token counts, but for the padded all-gather dispatcher, which takes every rank's
  // micro-batch to have this one's shape (it exchanges no counts).
  const bool same_tokens = cfg.moe.router.pad_to_capacity &&
                           cfg.moe.dispatcher_type == DispatcherType::AllGather;
  const int64_t n = same_tokens ? 5 : 5 + me, H = cfg.hidden;
  const auto x = testing::random_vec<float>(n * H, 100 + 31 * me);
  const auto dy = testing::random_vec<float>(n * H, 200 + 31 * me);
  Bf16Run r{std::vector<float>(n * H), std::vector<float>(n * H), {}, 0, 0};
  const int64_t before = ep_comm(g).all_to_all_bytes_sent();
  params.zero_grads();
  layer.forward(r.y.data(), x.data(), n);
  layer.backward(r.dx.data(), dy.data(), 1.0);
  r.a2a_bytes = ep_comm(g).all_to_all_bytes_sent() - before;
  const DispatchPlan& p = layer.plan();
  for (int64_t q = 0; q < p.ep_size; ++q)
    if (q != ep_comm(g).rank() && p.send_rows_R != nullptr) {
      r.rows_left += p.send_rows_R[q];
      r.rows_came += p.recv_rows_R[q];
    }
  for (const Param& prm : params.params()) {
    const float* gr = host(prm.grad_as<float>());
    r.grads.emplace_back(gr, gr + prm.local_numel());
  }
  return r;
}

TEST(EpMoELayerMpi, Bf16RowsKeepTheF32RowsGradientsWithHalfTheRowBytes) {
  std::vector<ProcessGroups*> all = layouts();
  if (g_etp2 != nullptr) all.push_back(g_etp2);
  for (ProcessGroups* g : all)
    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather})
      for (bool pad : {false, true})
        for (bool bias : {false, true}) {
          const int me = ep_comm(g).rank();
          SCOPED_TRACE(::testing::Message()
                       << "EP=" << g->degrees().ep << " ETP=" << g->degrees().etp
                       << (type == DispatcherType::AlltoAll ? " alltoall" : " allgather")
                       << (pad ? " padded" : " dropless") << (bias ? " biases" : ""));
          ModelConfig cfg = dispatcher_config(2, pad ? 1.0 : 0.0, type);
          cfg.hidden = 16;  // rows of whole 16-byte vectors in bf16
          cfg.moe.router.pad_to_capacity = pad;
          cfg.add_mlp_bias = bias;
          const Bf16Run f32 = run_bf16_layer(cfg, g, false, me);
          const Bf16Run b16 = run_bf16_layer(cfg, g, true, me);
          const double dy = rel_distance(b16.y, f32.y), ddx = rel_distance(b16.dx, f32.dx);
          std::printf("[ bf16 way back ] rank %d EP %d ETP %d %s%s%s: output %.3g, input grad "
                      "%.3g of the norm\n",
                      me, g->degrees().ep, g->degrees().etp,
                      type == DispatcherType::AlltoAll ? "alltoall" : "allgather",
                      pad ? " padded" : " dropless", bias ? " biases" : "", dy, ddx);
          if (type == DispatcherType::AllGather && g->degrees().etp > 1) {
            EXPECT_EQ(b16.y, f32.y) << "output";
            EXPECT_EQ(b16.dx, f32.dx) << "input grad";
          } else {
            EXPECT_LE(dy, 0x1p-8) << "output";
            EXPECT_LE(ddx, 0x1p-8) << "input grad";
            EXPECT_NE(b16.y, f32.y) << "output: the rows were not rounded";
            EXPECT_NE(b16.dx, f32.dx) << "input grad: the rows were not rounded";
          }
          ASSERT_EQ(b16.grads.size(), f32.grads.size());
          for (size_t i = 0; i < f32.grads.size(); ++i) EXPECT_EQ(b16.grads[i], f32.grads[i]) << i;
          if (type == DispatcherType::AlltoAll) {
            EXPECT_EQ(b16.rows_left, f32.rows_left);
            EXPECT_EQ(b16.rows_came, f32.rows_came);
            EXPECT_GT(f32.rows_left, 0) << "rows must leave this rank";
            EXPECT_GT(f32.rows_came, 0) << "rows must come to this rank";
            const int64_t phases = bias ? 1 : 2;  // the dispatch, and the combine's backward
            // Out: the dispatch (and the combine's backward); back: the combine and the
            // dispatch's backward.
            EXPECT_EQ(f32.a2a_bytes - b16.a2a_bytes,
                      2 * cfg.hidden * (phases * f32.rows_left + 2 * f32.rows_came));
          }
        }
}

// The whole model with EP groups: each rank's loss and gradients equal the one-rank model's on
// the same micro-batch (dropless: routing is per token, aux/z losses per rank); the expert
// grads, which see every EP rank's tokens, equal the one-rank grads summed over EP.
TEST(EpGPTModelMpi, EachRankMatchesTheOneRankModelOnItsMicroBatch) {
  for (ProcessGroups* g : layouts())
    for (bool qwen : {false, true}) {
      Communicator& c = ep_comm(g);
      const int me = c.rank();
      SCOPED_TRACE(::testing::Message() << "EP=" << c.size() << " gate+output bias=" << qwen);
      ModelConfig cfg = testing::tiny_moe_config();
      cfg.num_heads = 2;
      cfg.moe.router.aux_loss_coeff = 0.1;
      // Qwen-style: a gated shared expert and the attention output bias (dense, replicated).
      cfg.moe.shared_ffn_hidden = qwen ? 4 : 0;
      cfg.moe.shared_expert_gate = qwen;
      cfg.add_attention_output_bias = qwen;
      const int64_t B = 2, n = B * cfg.seq_length;
      std::vector<int32_t> ids(n), targets(n);
      for (int64_t i = 0; i < n; ++i) {
        ids[i] = static_cast<int32_t>((i * 7 + 3 * me) % cfg.vocab_size);
        targets[i] = static_cast<int32_t>((i * 5 + me + 1) % cfg.vocab_size);
      }
      model::GPTModel<double> ep(cfg, B, 99, g), one(cfg, B, 99);
      const double l_ep = ep.forward(ids.data(), targets.data());
      const double l_one = one.forward(ids.data(), targets.data());
      EXPECT_NEAR(l_ep, l_one, 1e-12 * std::abs(l_one));
      ep.params().zero_grads();
      one.params().zero_grads();
      ep.backward(1.0);
      one.backward(1.0);
      for (const Param& pe : ep.params().params()) {
        const Param& po = one.params().get(pe.name());
        std::vector<double> go = grad(po);
        int64_t first = 0;
        if (pe.spec.kind == ParamKind::Expert) {
          c.all_reduce(go);
          first = pe.spec.slice.offset * (po.local_numel() / pe.spec.global_shape[0]);
        }
        EXPECT_TRUE(all_close(
            grad(pe),
            std::vector<double>(go.begin() + first, go.begin() + first + pe.local_numel()),
            testing::kF64Rtol, testing::kF64Atol))
            << pe.name();
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
  int rc = 0;
  {
    ParallelConfig c2, c4, c22;
    c2.ep = 2;
    c4.ep = 4;
    c22.ep = 2;
    c22.etp = 2;
    c2.timeout_minutes = c4.timeout_minutes = c22.timeout_minutes = 1.0;  // deadlock: diagnostic
    ProcessGroups ep2(make_layout(c2, moe::g_rt.world_size), moe::g_rt.rank);
    ProcessGroups ep4(make_layout(c4, moe::g_rt.world_size), moe::g_rt.rank);
    ProcessGroups etp2(make_layout(c22, moe::g_rt.world_size), moe::g_rt.rank);
    connect_communicators(ep2);
    connect_communicators(ep4);
    connect_communicators(etp2);
    moe::g_ep2 = &ep2;
    moe::g_ep4 = &ep4;
    moe::g_etp2 = moe::g_rt.world_size == 4 ? &etp2 : nullptr;
    rc = RUN_ALL_TESTS();
    rc = moecore::testing::any_rank_failed(rc, ep2.world().communicator());
    rc = moecore::testing::report_skips(rc, moe::g_rt.rank, moe::g_rt.world_size);
    moe::g_ep2 = moe::g_ep4 = moe::g_etp2 = nullptr;
  }
  runtime_finalize();
  return rc;
}
