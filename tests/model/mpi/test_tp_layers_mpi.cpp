// Tensor and sequence parallelism in the transformer layers under mpirun (2 or 4 ranks): TP = 2
// (and TP = 4 on 4 ranks), each with and without --sequence-parallel. Every layer runs in f64 on
// its TP shards and, on every rank, as the one-rank layer with the same global parameters and
// inputs; the forward output, the input gradient and every parameter gradient (the TP shards
// gathered into global tensors via param_global_index; the replicated ones with partial gradients
// summed over TP first, the others compared as they are) must agree within docs/numerics.md's
// "TP layer parity" row.
// - SelfAttention: GQA, QKV bias, output projection bias, qk-layernorm, attention dropout.
// - MlaAttention: with and without q LoRA, the latents' norms, YaRN and RoPE, padded heads for
//   v or for q / k, attention dropout.
// - nn::MLP: SwiGLU and GeLU with biases, with and without the "mlp" recomputation.
// - SharedExperts: its input the rank's sequence slice; ungated and gated.
// - TransformerBlock: a dense block (LayerNorm, GeLU, biases, hidden and attention dropout) and a
//   MoE block with a gated shared expert (EP = ETP = 1: the experts stay whole; the MoE layer's
//   parameters see this rank's tokens, so their gradients are summed over TP), each also under
//   selective recomputation of every module; a MoE block with MLA, also under recomputation
//   (mla_up_proj too).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "common/mpi_testing.h"
#include "common/tiny_model_config.h"
#include "model/attention.h"
#include "model/mla_attention.h"
#include "model/transformer_block.h"
#include "moe/shared_experts.h"
#include "nn/mlp.h"
#include "parallel/process_groups.h"
#include "parallel/tensor_parallel.h"

namespace moecore::model {

using testing::host;
namespace {

using parallel::ProcessGroups;
using parallel::TensorParallel;
using testing::random_vec;

// docs/numerics.md, "TP layer parity" (f64).
constexpr double kTol = 1e-12;

parallel::Runtime g_rt;
std::vector<ProcessGroups*> g_layouts;  // TP 2 (and 4), each without and with SP

std::string describe(const TensorParallel& tp) {
  return "tp=" + std::to_string(tp.size()) + (tp.sequence_parallel() ? " sp" : "");
}

// A deterministic value of a parameter's global element, the same in every layout (non-trivial
// for the biases and norms too, so their paths carry signal).
double param_value(const Param& p, int64_t global) {
  uint64_t h = 1469598103934665603ull;
  for (char c : p.name()) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  const double base = p.spec.init == ParamInit::Ones ? 1.0 : 0.0;
  return base + 0.3 * std::sin(0.37 * global + static_cast<double>(h % 1000));
}
void set_values(ParamRegistry& params) {
  for (Param& p : params.params()) {
    double* d = host(p.data_as<double>());
    for (int64_t l = 0; l < p.local_numel(); ++l) d[l] = param_value(p, param_global_index(p, l));
  }
}

// max |a - b| over the rows [first, first + rows) of the reference's [., H] tensor.
double row_err(const std::vector<double>& local, const std::vector<double>& ref, int64_t first,
               int64_t rows, int64_t H) {
  double e = 0;
  for (int64_t i = 0; i < rows * H; ++i) e = std::max(e, std::abs(local[i] - ref[first * H + i]));
  return e;
}

// Every parameter gradient of `tp_params` against the one-rank registry's: the shards gathered
// (each global element held by one TP rank), the whole ones summed over TP when partial.
// Returns the largest difference.
double check_grads(const ParamRegistry& tp_params, const ParamRegistry& ref,
                   const TensorParallel& tp, const std::function<bool(const Param&)>& partial) {
  double worst = 0;
  for (const Param& p : tp_params.params()) {
    const Param* r = ref.find(p.name());
    EXPECT_NE(r, nullptr) << p.name();
    if (r == nullptr) continue;
    const double* g = host(p.grad_as<double>());
    std::vector<double> global(r->global_numel(), 0.0);
    // A dense parameter's slice is its TP shard (an expert's: its EP slice, here all experts).
    const bool sharded = !p.spec.slice.whole();
    if (p.spec.kind == ParamKind::Dense) {
      EXPECT_EQ(sharded, p.spec.tp_role == TpRole::Sharded) << p.name();
    }
    for (int64_t l = 0; l < p.local_numel(); ++l) global[param_global_index(p, l)] = g[l];
    if (sharded || p.spec.tp_role == TpRole::ReplicatedPartialGrad || partial(p))
      tp.all_reduce(cpu_exec(), DevPtr<double>(global.data()), r->global_numel());
    const double* rg = host(r->grad_as<double>());
    double e = 0;
    for (int64_t i = 0; i < r->global_numel(); ++i) e = std::max(e, std::abs(global[i] - rg[i]));
    EXPECT_LE(e, kTol) << p.name() << " " << describe(tp);
    worst = std::max(worst, e);
  }
  return worst;
}

void report(const char* what, const TensorParallel& tp, double out, double grads) {
  if (g_rt.rank == 0)
    std::printf("[tp parity] %s %s: output/dx max diff %.3g, parameter gradients %.3g\n", what,
                describe(tp).c_str(), out, grads);
}

ModelConfig attention_config() {
  ModelConfig cfg;
  cfg.hidden = 16;
  cfg.num_heads = 8;
  cfg.num_query_groups = 4;  // GQA, D = 2
  cfg.kv_channels = 4;
  cfg.ffn_hidden = 12;
  cfg.init_std = 0.3;
  cfg.add_qkv_bias = cfg.add_attention_output_bias = cfg.qk_layernorm = true;
  cfg.attention_dropout = 0.25;
  return cfg;
}

constexpr int64_t S = 4, B = 2, n = S * B;

TEST(TpLayers, SelfAttention) {
  ModelConfig cfg = attention_config();
  const int64_t H = cfg.hidden;
  const ops::RopeTables rope(S, cfg.head_dim(), cfg.rotary_base);
  ops::DropoutCounters counters{7, 3};
  const auto x = random_vec<double>(n * H, 1), dy = random_vec<double>(n * H, 2);
  ParamRegistry ref_params(DType::F64);
  SelfAttention<double> ref(cfg, ref_params, "attn", rope);
  Arena ref_arena;
  testing::plan_layer(ref_arena, ref_params, 1, [&](Arena& a) { ref.allocate(a, S, B); });
  set_values(ref_params);
  ops::AttentionDropout ref_drop{cfg.attention_dropout, 99, &counters, ref.first_head()};
  ref.set_dropout(&ref_drop);
  std::vector<double> y_ref(n * H), dx_ref(n * H);
  ref.forward(y_ref.data(), x.data());
  ref.backward(dx_ref.data(), dy.data());
  for (ProcessGroups* g : g_layouts) {
    const TensorParallel tp = TensorParallel::attention(g);
    ParamRegistry params(DType::F64);
    SelfAttention<double> attn(cfg, params, "attn", rope, tp);
    Arena arena;
    testing::plan_layer(arena, params, 1, [&](Arena& a) { attn.allocate(a, S, B); });
    set_values(params);
    ops::AttentionDropout drop{cfg.attention_dropout, 99, &counters, attn.first_head()};
    attn.set_dropout(&drop);
    const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
    std::vector<double> y(nl * H), dx(nl * H);
    attn.forward(y.data(), x.data() + t0 * H);
    attn.backward(dx.data(), dy.data() + t0 * H);
    const double out = std::max(row_err(y, y_ref, t0, nl, H), row_err(dx, dx_ref, t0, nl, H));
    EXPECT_LE(out, kTol) << describe(tp);
    report("attention", tp, out, check_grads(params, ref_params, tp, [](const Param&) { return false; }));
  }
}

// Multi-latent attention: the latents enter the TP region (all-gathered with SP), the up
// projections are column-parallel over the heads, linear_proj row-parallel; with q LoRA, the
// latents' norms, YaRN, v narrower than q / k (padded heads), linear_proj's bias and attention
// dropout; and without
// q LoRA (linear_q_proj reads the gathered x), plain RoPE, v wider than q / k. The down
// projections' and norms' gradients: partial sums with SP, whole on every rank without.
TEST(TpLayers, MultiLatentAttention) {
  struct Case {
    const char* name;
    int64_t q_lora, qk, dv;
    ops::RopeType rope;
    double dropout;
  };
  for (const Case& c : {Case{"q LoRA, yarn, dropout, dv < qk + pe", 6, 3, 5,
                             ops::RopeType::Yarn, 0.25},
                        Case{"linear_q_proj, rope, dv > qk + pe", 0, 2, 9, ops::RopeType::Rope,
                             0.0}}) {
    SCOPED_TRACE(c.name);
    ModelConfig cfg;
    cfg.hidden = 8;
    cfg.num_heads = 4;
    cfg.init_std = 0.3;
    cfg.qk_layernorm = true;
    cfg.attention_dropout = c.dropout;
    cfg.add_attention_output_bias = c.q_lora > 0;  // linear_proj.bias, added by TP rank 0
    cfg.multi_latent_attention = true;
    cfg.mla.q_lora_rank = c.q_lora;
    cfg.mla.kv_lora_rank = 5;
    cfg.mla.qk_head_dim = c.qk;
    cfg.mla.qk_pos_emb_head_dim = 4;
    cfg.mla.v_head_dim = c.dv;
    cfg.mla.rope_type = c.rope;
    cfg.mla.yarn = ops::YarnParams{4.0, 2, 32.0, 1.0, 1.0, 0.8};
    const int64_t H = cfg.hidden;
    const ops::RopeMlaTables rope(S, cfg.mla.rope_spec(cfg.rotary_base));
    ops::DropoutCounters counters{7, 3};
    const auto x = random_vec<double>(n * H, 11), dy = random_vec<double>(n * H, 12);
    ParamRegistry ref_params(DType::F64);
    MlaAttention<double> ref(cfg, ref_params, "attn", rope);
    Arena ref_arena;
    testing::plan_layer(ref_arena, ref_params, 1, [&](Arena& a) { ref.allocate(a, S, B); });
    set_values(ref_params);
    ops::AttentionDropout ref_drop{c.dropout, 99, &counters, ref.first_head()};
    if (c.dropout > 0) ref.set_dropout(&ref_drop);
    std::vector<double> y_ref(n * H), dx_ref(n * H);
    ref.forward(y_ref.data(), x.data());
    ref.backward(dx_ref.data(), dy.data());
    for (ProcessGroups* g : g_layouts) {
      const TensorParallel tp = TensorParallel::attention(g);
      ParamRegistry params(DType::F64);
      MlaAttention<double> mla(cfg, params, "attn", rope, tp);
      Arena arena;
      testing::plan_layer(arena, params, 1, [&](Arena& a) { mla.allocate(a, S, B); });
      set_values(params);
      EXPECT_EQ(mla.first_head(), tp.rank() * (cfg.num_heads / tp.size()));
      ops::AttentionDropout drop{c.dropout, 99, &counters, mla.first_head()};
      if (c.dropout > 0) mla.set_dropout(&drop);
      const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
      std::vector<double> y(nl * H), dx(nl * H);
      mla.forward(y.data(), x.data() + t0 * H);
      mla.backward(dx.data(), dy.data() + t0 * H);
      const double out = std::max(row_err(y, y_ref, t0, nl, H), row_err(dx, dx_ref, t0, nl, H));
      EXPECT_LE(out, kTol) << describe(tp);
      for (const Param& p : params.params()) {
        const bool down = p.name().find("down_proj") != std::string::npos ||
                          p.name().find("layernorm") != std::string::npos;
        if (down) {
          EXPECT_EQ(p.spec.tp_role, tp.token_role()) << p.name();
        }
      }
      report(c.q_lora > 0 ? "mla q lora" : "mla q proj", tp, out,
             check_grads(params, ref_params, tp, [](const Param&) { return false; }));
    }
  }
}

TEST(TpLayers, Mlp) {
  const int64_t H = 8, F = 12;
  const auto x = random_vec<double>(n * H, 3), dy = random_vec<double>(n * H, 4);
  for (ops::Activation act : {ops::Activation::SwiGLU, ops::Activation::GeLU}) {
    for (bool recompute : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "act " << static_cast<int>(act) << " recompute "
                                        << recompute);
      ParamRegistry ref_params(DType::F64);
      nn::MLP<double> ref(H, F, act, true, 0.3, 0.2, ref_params, "mlp");
      Arena ref_arena;
      testing::plan_layer(ref_arena, ref_params, 1, [&](Arena& a) { ref.allocate(a, n, recompute); });
      set_values(ref_params);
      std::vector<double> y_ref(n * H), dx_ref(n * H);
      ref.forward(y_ref.data(), x.data(), n);
      ref.backward(dx_ref.data(), dy.data());
      for (ProcessGroups* g : g_layouts) {
        const TensorParallel tp = TensorParallel::attention(g);
        if (tp.sequence_parallel()) continue;  // the MLP alone knows no SP: its callers' matter
        ParamRegistry params(DType::F64);
        nn::MLP<double> mlp(H, F, act, true, 0.3, 0.2, params, "mlp", tp.shard());
        EXPECT_EQ(mlp.local_ffn(), F / tp.size());
        Arena arena;
        testing::plan_layer(arena, params, 1, [&](Arena& a) { mlp.allocate(a, n, recompute); });
        set_values(params);
        std::vector<double> y(n * H), dx(n * H);
        mlp.forward(y.data(), x.data(), n);
        mlp.backward(dx.data(), dy.data());
        // Partial sums: the TP region's leave / enter_backward reduce them.
        tp.all_reduce(cpu_exec(), DevPtr<double>(y.data()), n * H);
        tp.all_reduce(cpu_exec(), DevPtr<double>(dx.data()), n * H);
        const double out = std::max(row_err(y, y_ref, 0, n, H), row_err(dx, dx_ref, 0, n, H));
        EXPECT_LE(out, kTol) << describe(tp);
        report(act == ops::Activation::SwiGLU ? "mlp swiglu" : "mlp gelu", tp, out,
               check_grads(params, ref_params, tp, [](const Param&) { return false; }));
      }
    }
  }
}

MoeLayerConfig shared_config(bool gated) {
  MoeLayerConfig c;
  c.hidden = 8;
  c.num_experts = 4;
  c.init_std = c.output_init_std = 0.3;
  c.moe.shared_ffn_hidden = 8;
  c.moe.shared_expert_gate = gated;
  c.add_mlp_bias = true;
  return c;
}

TEST(TpLayers, SharedExperts) {
  const int64_t H = 8;
  const auto x = random_vec<double>(n * H, 5), dy = random_vec<double>(n * H, 6);
  for (bool gated : {false, true}) {
    SCOPED_TRACE(gated ? "gated" : "ungated");
    const MoeLayerConfig cfg = shared_config(gated);
    ParamRegistry ref_params(DType::F64);
    moe::SharedExperts<double> ref(cfg, ref_params, "moe");
    Arena ref_arena;
    testing::plan_layer(ref_arena, ref_params, 1,
                        [&](Arena& a) { ref.allocate(a, n, {}, false, false); });
    set_values(ref_params);
    std::vector<double> y_ref(n * H, 0.0), dx_ref(n * H, 0.0);
    ref.forward(y_ref.data(), x.data(), x.data(), n);
    ref.backward(dx_ref.data(), dy.data(), dy.data());
    for (ProcessGroups* g : g_layouts) {
      // The MoE layer's tokens: this rank's sequence slice, with or without --sequence-parallel.
      const TensorParallel tp = TensorParallel::attention(g).with_sequence_parallel();
      if (TensorParallel::attention(g).sequence_parallel()) continue;  // the same layout
      ParamRegistry params(DType::F64);
      moe::SharedExperts<double> shared(cfg, params, "moe", g);
      Arena arena;
      const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
      testing::plan_layer(arena, params, 1,
                          [&](Arena& a) { shared.allocate(a, nl, {}, false, false); });
      set_values(params);
      std::vector<double> y(nl * H, 0.0), dx(nl * H, 0.0);
      shared.forward(y.data(), x.data() + t0 * H, x.data() + t0 * H, nl);
      shared.backward(dx.data(), dy.data() + t0 * H, dy.data() + t0 * H);
      const double out = std::max(row_err(y, y_ref, t0, nl, H), row_err(dx, dx_ref, t0, nl, H));
      EXPECT_LE(out, kTol) << describe(tp);
      report(gated ? "shared expert gated" : "shared expert", tp, out,
             check_grads(params, ref_params, tp, [](const Param&) { return false; }));
    }
  }
}

ModelConfig block_config(bool moe) {
  ModelConfig cfg = attention_config();
  cfg.hidden_dropout = 0.2;
  if (!moe) {
    cfg.normalization = Normalization::LayerNorm;
    cfg.activation = ops::Activation::GeLU;
    cfg.add_mlp_bias = true;
    return cfg;
  }
  cfg.num_experts = 4;
  cfg.moe.router.num_experts = 4;
  cfg.moe.router.topk = 2;
  cfg.moe.ffn_hidden = 4;
  cfg.moe.shared_ffn_hidden = 8;
  cfg.moe.shared_expert_gate = true;
  return cfg;
}

TEST(TpLayers, TransformerBlock) {
  const ops::DropoutCounters counters{5, 2};
  for (auto [is_moe, recompute, mla] :
       {std::tuple{false, false, false}, {true, false, false}, {false, true, false},
        {true, true, false}, {true, false, true}, {true, true, true}}) {
    SCOPED_TRACE(::testing::Message() << (is_moe ? "moe block" : "dense block")
                                      << (mla ? " mla" : "")
                                      << (recompute ? " selective recomputation" : ""));
    ModelConfig cfg = block_config(is_moe);
    if (mla) {  // q LoRA, the latents' norms (--qk-layernorm), YaRN, padded heads
      testing::use_tiny_mla(cfg);
      cfg.mla.yarn = ops::YarnParams{4.0, 2, 32.0, 1.0, 1.0, 0.8};
    }
    const ops::RopeMlaTables mla_rope(S, cfg.mla.rope_spec(cfg.rotary_base));
    if (recompute) {  // every module: the reruns repeat the TP regions' collectives
      cfg.recompute.granularity = RecomputeGranularity::Selective;
      cfg.recompute.module_names = {"core_attn", "layernorm", "mlp", "moe", "shared_experts"};
      if (mla) cfg.recompute.module_names.push_back("mla_up_proj");
    }
    const int64_t H = cfg.hidden;
    const ops::RopeTables rope(S, cfg.head_dim(), cfg.rotary_base);
    const auto x = random_vec<double>(n * H, 7), dy = random_vec<double>(n * H, 8);
    ParamRegistry ref_params(DType::F64);
    TransformerBlock<double> ref(cfg, 0, ref_params, rope, nullptr, 11, &mla_rope.cache());
    ASSERT_EQ(ref.is_moe(), is_moe);
    Arena ref_arena;
    testing::plan_layer(ref_arena, ref_params, 1, [&](Arena& a) { ref.allocate(a, S, B); });
    set_values(ref_params);
    ref.set_dropout_counters(&counters);
    std::vector<double> y_ref(n * H), dx_ref(n * H);
    ref.forward(y_ref.data(), x.data());
    ref.backward(dx_ref.data(), dy.data(), 1.0);
    for (ProcessGroups* g : g_layouts) {
      const TensorParallel tp = TensorParallel::attention(g);
      ParamRegistry params(DType::F64);
      TransformerBlock<double> block(cfg, 0, params, rope, g, 11, &mla_rope.cache());
      Arena arena;
      testing::plan_layer(arena, params, 1, [&](Arena& a) { block.allocate(a, S, B); });
      set_values(params);
      block.set_dropout_counters(&counters);
      const int64_t nl = tp.local_tokens(n), t0 = tp.first_token(n);
      std::vector<double> y(nl * H), dx(nl * H);
      block.forward(y.data(), x.data() + t0 * H);
      block.backward(dx.data(), dy.data() + t0 * H, 1.0);
      const double out = std::max(row_err(y, y_ref, t0, nl, H), row_err(dx, dx_ref, t0, nl, H));
      EXPECT_LE(out, kTol) << describe(tp);
      // The MoE layer's whole parameters (router, experts at EP = ETP = 1) see this rank's
      // tokens: partial gradients.
      auto moe_partial = [](const Param& p) {
        return p.name().find(".mlp.") != std::string::npos && p.spec.slice.whole();
      };
      report(mla ? "mla moe block" : is_moe ? "moe block" : "dense block", tp, out,
             check_grads(params, ref_params, tp, moe_partial));
    }
  }
}

}  // namespace
}  // namespace moecore::model

int main(int argc, char** argv) {
  using namespace moecore;
  using namespace moecore::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  model::g_rt = runtime_init(&argc, &argv);
  moecore::testing::quiet_gtest_on_other_ranks(model::g_rt.rank);
  int rc = 0;
  {
    std::vector<std::unique_ptr<ProcessGroups>> groups;
    for (int tp : {2, 4}) {
      if (tp > model::g_rt.world_size || model::g_rt.world_size % tp != 0) continue;
      for (bool sp : {false, true}) {
        ParallelConfig c;
        c.tp = tp;
        c.etp = 1;
        c.sequence_parallel = sp;
        c.timeout_minutes = 1.0;  // a deadlock ends with a diagnostic
        groups.push_back(std::make_unique<ProcessGroups>(make_layout(c, model::g_rt.world_size),
                                                         model::g_rt.rank));
        connect_communicators(*groups.back());
        model::g_layouts.push_back(groups.back().get());
      }
    }
    rc = RUN_ALL_TESTS();
    rc = moecore::testing::any_rank_failed(rc, groups.front()->world().communicator());
    rc = moecore::testing::report_skips(rc, model::g_rt.rank, model::g_rt.world_size);
    model::g_layouts.clear();
  }
  runtime_finalize();
  return rc;
}
