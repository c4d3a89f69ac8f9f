// Context parallelism's attention under mpirun (2 or 4 ranks): cp 2 (and cp 4 on 4 ranks), with
// --cp-comm-type p2p (the ring) and all_gather. Each rank holds its load-balanced 2 C rows of
// the sequence (parallel/context_split.h); the attention core (parallel::ContextParallelAttention),
// the SelfAttention layer and the multi-latent attention layer with cp must equal the one-rank
// computation on the gathered sequence on every rank: out, lse, dq, dk, dv of the core; the
// layers' outputs, input gradients and every parameter gradient (summed over cp), in f64 with
// GQA and attention dropout, within docs/numerics.md's "CP attention parity" row.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "common/mpi_testing.h"
#include "common/tiny_model_config.h"
#include "core/arena.h"
#include "model/attention.h"
#include "model/mla_attention.h"
#include "ops/attention.h"
#include "parallel/context_parallel.h"
#include "parallel/context_parallel_attention.h"
#include "parallel/context_split.h"
#include "parallel/process_groups.h"

namespace moecore {
namespace {

using parallel::ContextParallel;
using parallel::CpCommType;
using parallel::ProcessGroups;
using testing::random_vec;

// docs/numerics.md, "CP attention parity" (f64).
constexpr double kTol = 1e-12;
constexpr double kTolF32 = 1e-5;

parallel::Runtime g_rt;
std::vector<ProcessGroups*> g_layouts;  // cp 2 (and 4)

std::string describe(const ContextParallel& cp) {
  return "cp=" + std::to_string(cp.size()) + " rank=" + std::to_string(cp.rank()) +
         (cp.type() == CpCommType::P2P ? " p2p" : " all_gather");
}

// This rank's rows of a sequence-major [S, row] tensor.
template <typename T>
std::vector<T> local_rows(const parallel::ContextSplit& sp, const std::vector<T>& x, int64_t row) {
  std::vector<T> out(sp.local_length() * row);
  parallel::context_split_rows(sp, x.data(), row, out.data());
  return out;
}

template <typename T>
double max_diff(const std::vector<T>& a, const std::vector<T>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    e = std::max(e, double(std::abs(a[i] - b[i])));
  return e;
}

void report(const char* what, const ContextParallel& cp, double a, double b) {
  if (cp.rank() == 0)
    std::printf("[cp parity] %s %s: output max diff %.3g, gradients %.3g\n", what,
                describe(cp).c_str(), a, b);
}

// The core: GQA (Hq 4, Hkv 2), chunks of 3 rows (odd: dropout's groups of 4 keys cut across
// chunks), B 2, dropout 0.3 with the heads offset as on a TP rank. f64 within kTol; f32 (the
// trainer's and --bf16's core) within the f32 fast-vs-reference row (the blocks and the merge
// sum in another order), relative to values of order 1: an absolute bound here.
template <typename T>
void core_equals_one_rank(double tol) {
  for (ProcessGroups* g : g_layouts) {
    for (CpCommType type : {CpCommType::P2P, CpCommType::AllGather}) {
      const ContextParallel cp(&g->cp(), type);
      SCOPED_TRACE(describe(cp));
      const int64_t C = 3, S = 2 * cp.size() * C, B = 2, Hq = 4, Hkv = 2, D = 8;
      const ops::AttentionShape whole{S, B, Hq, Hkv, D};
      const int64_t rq = B * Hq * D, rk = B * Hkv * D;
      const auto q = random_vec<T>(S * rq, 1, -2.0, 2.0), k = random_vec<T>(S * rk, 2, -2.0, 2.0);
      const auto v = random_vec<T>(S * rk, 3), dout = random_vec<T>(S * rq, 4);
      const ops::DropoutCounters counters{5, 2};
      const ops::AttentionDropout drop{0.3, 77, &counters, 4};
      // The one-rank attention (the CPU fast path) of the whole sequence.
      std::vector<T> out(S * rq), lse(B * Hq * S), dq(S * rq), dk(S * rk), dv(S * rk);
      std::vector<T> ws(ops::attention_workspace_elems(whole, omp_get_max_threads()));
      ops::attention_forward<T>(cpu_exec(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                                whole, ws.data(), &drop);
      ops::attention_backward<T>(cpu_exec(), dq.data(), dk.data(), dv.data(), dout.data(), q.data(),
                                 k.data(), v.data(), out.data(), lse.data(), whole, ws.data(),
                                 &drop);
      const parallel::ContextSplit sp = cp.split(S);
      const int64_t L = sp.local_length();
      const auto q_l = local_rows(sp, q, rq), k_l = local_rows(sp, k, rk),
                 v_l = local_rows(sp, v, rk), dout_l = local_rows(sp, dout, rq);
      parallel::ContextParallelAttention<T> cpa(cp);
      Arena arena;
      arena.plan([&](Arena& a) { cpa.allocate(a, ops::AttentionShape{L, B, Hq, Hkv, D}); });
      std::vector<T> out_l(L * rq), lse_l(B * Hq * L), dq_l(L * rq), dk_l(L * rk), dv_l(L * rk);
      cpa.forward(out_l.data(), lse_l.data(), q_l.data(), k_l.data(), v_l.data(), &drop);
      cpa.backward(dq_l.data(), dk_l.data(), dv_l.data(), dout_l.data(), q_l.data(), k_l.data(),
                   v_l.data(), out_l.data(), lse_l.data(), &drop);
      // lse [B, Hq, S] -> this rank's [B, Hq, 2C].
      std::vector<T> lse_want(B * Hq * L);
      for (int64_t bh = 0; bh < B * Hq; ++bh)
        for (int64_t s = 0; s < L; ++s) lse_want[bh * L + s] = lse[bh * S + sp.global_position(s)];
      const double e_out =
          std::max(max_diff(out_l, local_rows(sp, out, rq)), max_diff(lse_l, lse_want));
      const double e_grad =
          std::max({max_diff(dq_l, local_rows(sp, dq, rq)), max_diff(dk_l, local_rows(sp, dk, rk)),
                    max_diff(dv_l, local_rows(sp, dv, rk))});
      EXPECT_LE(e_out, tol) << "out / lse";
      EXPECT_LE(e_grad, tol) << "dq / dk / dv";
      report(sizeof(T) == 8 ? "core attention f64" : "core attention f32", cp, e_out, e_grad);
    }
  }
}

TEST(CpAttention, CoreEqualsOneRankF64) {
  core_equals_one_rank<double>(kTol);
}
TEST(CpAttention, CoreEqualsOneRankF32) {
  core_equals_one_rank<float>(kTolF32);
}

// A deterministic value of a parameter's element, the same in every layout.
double param_value(const Param& p, int64_t i) {
  uint64_t h = 1469598103934665603ull;
  for (char c : p.name()) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  const double base = p.spec.init == ParamInit::Ones ? 1.0 : 0.0;
  return base + 0.3 * std::sin(0.37 * i + static_cast<double>(h % 1000));
}
void set_values(ParamRegistry& params) {
  for (Param& p : params.params()) {
    double* d = testing::host(p.data_as<double>());
    for (int64_t l = 0; l < p.local_numel(); ++l) d[l] = param_value(p, l);
  }
}

// Every parameter gradient of the cp layer (a partial sum over this rank's tokens) summed over
// cp against the one-rank layer's; the largest difference.
double check_grads(const ParamRegistry& params, const ParamRegistry& ref,
                   const ContextParallel& cp) {
  double worst = 0;
  for (const Param& p : params.params()) {
    const Param* r = ref.find(p.name());
    EXPECT_NE(r, nullptr) << p.name();
    if (r == nullptr) continue;
    const double* g = testing::host(p.grad_as<double>());
    std::vector<double> sum(g, g + p.local_numel());
    cp.communicator().all_reduce(sum);
    const double* rg = testing::host(r->grad_as<double>());
    double e = 0;
    for (int64_t i = 0; i < r->global_numel(); ++i) e = std::max(e, std::abs(sum[i] - rg[i]));
    EXPECT_LE(e, kTol) << p.name();
    worst = std::max(worst, e);
  }
  return worst;
}

// Runs the one-rank layer on the whole sequence and, for every layout and comm type, the layer
// with cp on this rank's rows; `make(params, cp)` builds a layer, `drop_of(layer)` its dropout.
// Compares the output, the input gradient and the parameter gradients.
template <typename Layer, typename Make>
void layer_equals_one_rank(const char* what, int64_t C, int64_t B, int64_t H, double dropout,
                           const Make& make) {
  for (ProcessGroups* g : g_layouts) {
    const int cp_size = g->cp().size();
    const int64_t S = 2 * cp_size * C, n = S * B;
    const auto x = random_vec<double>(n * H, 21), dy = random_vec<double>(n * H, 22);
    ops::DropoutCounters counters{7, 3};
    ParamRegistry ref_params(DType::F64);
    std::unique_ptr<Layer> ref = make(ref_params, S, ContextParallel{});
    Arena ref_arena;
    testing::plan_layer(ref_arena, ref_params, 1, [&](Arena& a) { ref->allocate(a, S, B); });
    set_values(ref_params);
    ops::AttentionDropout ref_drop{dropout, 99, &counters, ref->first_head()};
    if (dropout > 0) ref->set_dropout(&ref_drop);
    std::vector<double> y_ref(n * H), dx_ref(n * H);
    ref->forward(y_ref.data(), x.data());
    ref->backward(dx_ref.data(), dy.data());
    for (CpCommType type : {CpCommType::P2P, CpCommType::AllGather}) {
      const ContextParallel cp(&g->cp(), type);
      SCOPED_TRACE(std::string(what) + " " + describe(cp));
      const parallel::ContextSplit sp = cp.split(S);
      const int64_t L = sp.local_length();
      ParamRegistry params(DType::F64);
      std::unique_ptr<Layer> layer = make(params, S, cp);
      Arena arena;
      testing::plan_layer(arena, params, 1, [&](Arena& a) { layer->allocate(a, L, B); });
      set_values(params);
      ops::AttentionDropout drop{dropout, 99, &counters, layer->first_head()};
      if (dropout > 0) layer->set_dropout(&drop);
      std::vector<double> y(L * B * H), dx(L * B * H);
      const auto x_l = local_rows(sp, x, B * H);  // the layer reads it again in backward
      layer->forward(y.data(), x_l.data());
      layer->backward(dx.data(), local_rows(sp, dy, B * H).data());
      const double out = std::max(max_diff(y, local_rows(sp, y_ref, B * H)),
                                  max_diff(dx, local_rows(sp, dx_ref, B * H)));
      EXPECT_LE(out, kTol) << "output / input gradient";
      report(what, cp, out, check_grads(params, ref_params, cp));
    }
  }
}

// SelfAttention: GQA (8 heads in 4 groups), QKV and output biases, qk-layernorm, RoPE at the
// rows' global positions, attention dropout; also with the core recomputed in the backward.
TEST(CpAttention, SelfAttentionEqualsOneRank) {
  for (bool recompute : {false, true}) {
    ModelConfig cfg;
    cfg.hidden = 16;
    cfg.num_heads = 8;
    cfg.num_query_groups = 4;
    cfg.kv_channels = 4;
    cfg.ffn_hidden = 12;
    cfg.init_std = 0.3;
    cfg.add_qkv_bias = cfg.add_attention_output_bias = cfg.qk_layernorm = true;
    cfg.attention_dropout = 0.25;
    if (recompute) cfg.recompute.granularity = RecomputeGranularity::Selective;
    std::unique_ptr<ops::RopeTables> rope;
    layer_equals_one_rank<model::SelfAttention<double>>(
        recompute ? "self attention, core recomputed" : "self attention", 3, 2, cfg.hidden,
        cfg.attention_dropout, [&](ParamRegistry& params, int64_t S, const ContextParallel& cp) {
          if (rope == nullptr || rope->cache().max_pos < S)
            rope = std::make_unique<ops::RopeTables>(S, cfg.head_dim(), cfg.rotary_base);
          return std::make_unique<model::SelfAttention<double>>(cfg, params, "attn", *rope,
                                                                parallel::TensorParallel{}, cp);
        });
  }
}

// Multi-latent attention: q LoRA, the latents' norms, YaRN at the global positions, v narrower
// than q / k (padded heads), linear_proj's bias, attention dropout.
TEST(CpAttention, MultiLatentAttentionEqualsOneRank) {
  ModelConfig cfg;
  cfg.hidden = 8;
  cfg.num_heads = 4;
  cfg.init_std = 0.3;
  cfg.qk_layernorm = true;
  cfg.attention_dropout = 0.25;
  cfg.add_attention_output_bias = true;
  testing::use_tiny_mla(cfg);
  cfg.mla.rope_type = ops::RopeType::Yarn;
  cfg.mla.yarn = ops::YarnParams{4.0, 2, 32.0, 1.0, 1.0, 0.8};
  std::unique_ptr<ops::RopeMlaTables> rope;
  layer_equals_one_rank<model::MlaAttention<double>>(
      "mla", 3, 2, cfg.hidden, cfg.attention_dropout,
      [&](ParamRegistry& params, int64_t S, const ContextParallel& cp) {
        if (rope == nullptr || rope->cache().max_pos < S)
          rope = std::make_unique<ops::RopeMlaTables>(S, cfg.mla.rope_spec(cfg.rotary_base));
        return std::make_unique<model::MlaAttention<double>>(cfg, params, "attn", *rope,
                                                             parallel::TensorParallel{}, cp);
      });
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  using namespace moecore;
  using namespace moecore::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  g_rt = runtime_init(&argc, &argv);
  moecore::testing::quiet_gtest_on_other_ranks(g_rt.rank);
  int rc = 0;
  {
    std::vector<std::unique_ptr<ProcessGroups>> groups;
    for (int cp : {2, 4}) {
      if (cp > g_rt.world_size || g_rt.world_size % cp != 0) continue;
      ParallelConfig c;
      c.cp = cp;
      c.timeout_minutes = 1.0;  // a deadlock ends with a diagnostic
      groups.push_back(std::make_unique<ProcessGroups>(make_layout(c, g_rt.world_size), g_rt.rank));
      connect_communicators(*groups.back());
      g_layouts.push_back(groups.back().get());
    }
    rc = RUN_ALL_TESTS();
    if (!groups.empty())
      rc = moecore::testing::any_rank_failed(rc, groups.front()->world().communicator());
    rc = moecore::testing::report_skips(rc, g_rt.rank, g_rt.world_size);
    g_layouts.clear();
  }
  runtime_finalize();
  return rc;
}
