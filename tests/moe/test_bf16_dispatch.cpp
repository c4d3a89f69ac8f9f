// --bf16 dispatch (MoELayer::set_bf16_dispatch, on by default): the tokens cast to bf16 once
// before the permutation, and without MLP biases the output gradient before the combine's
// backward, so the permutation moves bf16 rows that the experts' GEMMs read as they are. The
// GEMMs cast their inputs to bf16 themselves when the rows arrive in f32 (and the widened path
// reads them rounded), so both give the same bits: every parameter gradient compared bit for bit
// with the f32 rows on every bf16 GEMM path the CPU has, and the saved expert rows half the size.
// The way back moves bf16 rows too: fc2's output rows and fc1's input-gradient rows rounded once
// to bf16, each token summing its rows widened in f32. So the output and the input gradient carry
// one rounding per row: with top-1 the output is exactly the f32 rows' output rounded to bf16;
// with top-2 within the rounding's 2^-8 relative to the output's norm and never bitwise. The EP
// dispatchers' bf16 forms: tests/moe/mpi/.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/bf16_gemm_paths.h"
#include "common/layer_testing.h"
#include "common/testing.h"
#include "moe/moe_layer.h"
#include "ops/gemm_bf16.h"

namespace moecore::moe {
namespace {

using testing::host;
using testing::random_vec;
using testing::rel_distance;

struct Case {
  const char* name;
  int64_t shared = 0;
  bool gate = false;
  bool bias = false;  // GeLU with MLP biases: dy stays f32 (fc2's bias gradient sums it)
  bool pad = false;   // padded to capacity: pad rows are zero rows
  bool recompute_moe = false;
  int64_t topk = 2;
};

MoeLayerConfig config(const Case& c) {
  MoeLayerConfig cfg;
  cfg.hidden = 16;
  cfg.seq_length = 10;
  cfg.num_experts = 4;
  cfg.moe.router.num_experts = 4;
  cfg.moe.router.topk = c.topk;
  cfg.moe.router.pre_softmax = c.topk == 1;  // top-1 softmax routing needs it (prob < 1)
  cfg.moe.router.aux_loss_coeff = 0.05;
  cfg.moe.router.z_loss_coeff = 0.01;
  cfg.moe.ffn_hidden = 12;
  cfg.moe.shared_ffn_hidden = c.shared;
  cfg.moe.shared_expert_gate = c.gate;
  if (c.bias) {
    cfg.activation = ops::Activation::GeLU;
    cfg.add_mlp_bias = true;
  }
  if (c.pad) {
    cfg.moe.router.capacity_factor = 1.0;
    cfg.moe.router.pad_to_capacity = true;
  }
  cfg.recompute.moe = c.recompute_moe;
  cfg.init_std = 0.3;
  cfg.output_init_std = 0.2;
  return cfg;
}

struct Run {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;
  bool rows16 = false, dy16 = false;
  size_t activations = 0;  // the arena's MemKind::Activations bytes
};

Run run(const Case& c, bool bf16_dispatch) {
  const MoeLayerConfig cfg = config(c);
  const int64_t n = 10, H = cfg.hidden;
  ParamRegistry params(DType::F32);
  params.enable_bf16_copies(ops::bf16_gemm_path() == ops::Bf16GemmPath::Widen);
  MoELayer<float> layer(cfg, params, "moe");
  layer.set_bf16_dispatch(bf16_dispatch);
  Arena arena;
  testing::plan_layer(arena, params, 23, [&](Arena& a) { layer.allocate(a, n); });
  int b = 0;
  for (const Param& p : params.params()) {
    if (!p.name().ends_with(".bias")) continue;
    float* v = host(p.data_as<float>());
    for (int64_t i = 0; i < p.local_numel(); ++i) v[i] = 0.1f * std::sin(float(i + 7 * b));
    ++b;
  }
  params.refresh_bf16();
  const auto x = random_vec<float>(n * H, 41);
  const auto dy = random_vec<float>(n * H, 42);
  Run r{std::vector<float>(n * H), std::vector<float>(n * H), {},
        layer.bf16_rows(),         layer.bf16_dy_rows(),      arena.bytes_of(MemKind::Activations)};
  layer.forward(r.y.data(), x.data(), n);
  params.zero_grads();
  layer.backward(r.dx.data(), dy.data(), 1.0);
  for (const Param& p : params.params()) {
    const float* g = host(p.grad_as<float>());
    r.grads.emplace_back(g, g + p.local_numel());
  }
  return r;
}

void expect_runs(const Case& c) {
  SCOPED_TRACE(std::string(c.name) + " on the " + ops::bf16_gemm_path_name(ops::bf16_gemm_path()) +
               " bf16 GEMM path");
  const Run f32 = run(c, false), b16 = run(c, true);
  EXPECT_FALSE(f32.rows16);
  EXPECT_TRUE(b16.rows16);
  EXPECT_EQ(b16.dy16, !c.bias);
  // The expert rows' bf16 rounding on the way back (top-2: two rows per token, each rounded).
  std::printf("[ bf16 way back ] %s: output %.3g, input grad %.3g of the norm\n", c.name,
              rel_distance(b16.y, f32.y), rel_distance(b16.dx, f32.dx));
  EXPECT_LE(rel_distance(b16.y, f32.y), 0x1p-8) << "output";
  EXPECT_NE(b16.y, f32.y) << "output: the rows were not rounded";
  EXPECT_LE(rel_distance(b16.dx, f32.dx), 0x1p-8) << "input gradient";
  EXPECT_NE(b16.dx, f32.dx) << "input gradient: the rows were not rounded";
  ASSERT_EQ(b16.grads.size(), f32.grads.size());
  for (size_t i = 0; i < f32.grads.size(); ++i) EXPECT_EQ(b16.grads[i], f32.grads[i]) << i;
  // The saved expert rows: T K rows of H (padded: E x capacity, here also T K) in bf16, not f32;
  // on the widened path without a shared expert the f32 buffer of the input's rounded values
  // (T x H, kept for the experts' backward) is gone too. Recomputed under "moe": not kept.
  if (!c.recompute_moe) {
    const int64_t n = 10, H = 16, rows = n * 2;
    const bool widened = ops::bf16_gemm_path() == ops::Bf16GemmPath::Widen;
    const size_t saved = size_t(rows * H * 2 + (widened && c.shared == 0 ? n * H * 4 : 0));
    EXPECT_EQ(f32.activations - b16.activations, saved);
  }
}

TEST(Bf16Dispatch, MoELayerKeepsTheF32RowsGradientsOnEveryBf16GemmPath) {
  testing::for_each_bf16_gemm_path([](ops::Bf16GemmPath) {
    for (const Case& c : {Case{"plain"}, Case{"shared_gate", 8, true},
                          Case{"gelu_bias", 8, false, true}, Case{"padded", 0, false, false, true},
                          Case{"recompute_moe", 8, true, false, false, true}}) {
      expect_runs(c);
    }
  });
}

// Top-1 without a shared expert: each token's output is its one expert row (the f32 path adds it
// to 0, exactly), so the bf16 way back gives exactly the f32 rows' output rounded to bf16.
TEST(Bf16Dispatch, TopOneOutputIsTheF32OutputRoundedOnce) {
  for (bool bias : {false, true}) {
    Case c{bias ? "top1_bias" : "top1", 0, false, bias};
    c.topk = 1;
    SCOPED_TRACE(c.name);
    const auto f32 = run(c, false), b16 = run(c, true);
    ASSERT_TRUE(b16.rows16);
    ASSERT_EQ(b16.y.size(), f32.y.size());
    int64_t changed = 0;
    for (size_t i = 0; i < f32.y.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(b16.y[i]),
                std::bit_cast<uint32_t>(bf16_to_float(float_to_bf16(f32.y[i]))))
          << "element " << i;
      changed += b16.y[i] != f32.y[i];
    }
    EXPECT_GT(changed, 0);
    for (size_t i = 0; i < f32.grads.size(); ++i) EXPECT_EQ(b16.grads[i], f32.grads[i]) << i;
  }
}

// Without --bf16 (no bf16 weight copies) and in f64 the rows stay in the model's type.
TEST(Bf16Dispatch, OnlyUnderBf16) {
  const MoeLayerConfig cfg = config(Case{"plain"});
  {
    ParamRegistry params(DType::F32);
    MoELayer<float> layer(cfg, params, "moe");
    Arena arena;
    testing::plan_layer(arena, params, 23, [&](Arena& a) { layer.allocate(a, 10); });
    EXPECT_FALSE(layer.bf16_rows());
    EXPECT_FALSE(layer.bf16_dy_rows());
  }
  ParamRegistry params(DType::F64);
  MoELayer<double> layer(cfg, params, "moe");
  Arena arena;
  testing::plan_layer(arena, params, 23, [&](Arena& a) { layer.allocate(a, 10); });
  EXPECT_FALSE(layer.bf16_rows());
}

}  // namespace
}  // namespace moecore::moe
