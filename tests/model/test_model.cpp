// Model layers: attention block, dense MLP, transformer blocks (dense and MoE) and the whole GPT
// model against fp64 finite differences; f32 vs f64 agreement; config parsing and validation.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/bf16_gemm_paths.h"
#include "common/layer_testing.h"
#include "common/pipeline_stages.h"
#include "common/tiny_model_config.h"
#include "model/attention.h"
#include "model/gpt_model.h"
#include "nn/mlp.h"
#include "ops/gemm_bf16.h"
#include "ops/attention.h"
#include "ops/qkv_layout.h"
#include "ops/rope.h"
#include "ops/rope_mla.h"
#include "model/transformer_block.h"

namespace moecore::model {

using testing::host;
using testing::random_ids;
namespace {

// The bf16 GEMM path that matches the registry's bf16 copies (as the trainer chooses them:
// widened f32 copies for the widen path, bf16 ones for the native path), for the scope.
struct Bf16PathForCopies {
  explicit Bf16PathForCopies(bool widened) : chosen(ops::bf16_gemm_path()) {
    ops::set_bf16_gemm_path(widened ? ops::Bf16GemmPath::Widen : ops::Bf16GemmPath::Native);
  }
  ~Bf16PathForCopies() { ops::set_bf16_gemm_path(chosen); }
  ops::Bf16GemmPath chosen;
};

using testing::random_vec;

ModelConfig tiny_config() {
  ModelConfig cfg = testing::tiny_moe_config();
  cfg.moe_layer_pattern = {1, 0};
  cfg.moe.router.aux_loss_coeff = 0.1;
  cfg.moe.router.z_loss_coeff = 0.01;
  cfg.moe.shared_ffn_hidden = 4;
  cfg.tie_embeddings = false;
  return cfg;
}

// One f64 attention block over S = 5, B = 2 tokens with initialized parameters.
class SelfAttentionTest : public ::testing::Test {
 protected:
  static constexpr int64_t S = 5, B = 2, n = S * B;
  ModelConfig cfg = tiny_config();
  const int64_t H = cfg.hidden;
  ParamRegistry params{DType::F64};
  ops::RopeTables rope{S, cfg.head_dim(), cfg.rotary_base};
  SelfAttention<double> attn{cfg, params, "attn", rope};
  Arena arena;
  std::vector<double> x = random_vec<double>(n * H, 2);

  void SetUp() override {
    testing::plan_layer(arena, params, 1, [&](Arena& a) { attn.allocate(a, S, B); });
  }
};

TEST_F(SelfAttentionTest, FiniteDifferences) {
  auto R = random_vec<double>(n * H, 3);
  std::vector<double> y(n * H), dx(n * H);
  auto loss = [&] {
    attn.forward(y.data(), x.data());
    return testing::weighted_sum(y.data(), R);
  };
  EXPECT_TRUE(testing::check_layer_gradients(
      params, loss, [&] { attn.backward(dx.data(), R.data()); },
      {{x.data(), dx.data(), n * H, "dx"}}));
}

// --add-attention-output-bias: linear_proj.bias [H] (zeros, no weight decay), added after the
// projection; its gradient is the column sums of dy. Non-zero values so the forward adds them.
TEST(SelfAttention, OutputBiasFiniteDifferences) {
  constexpr int64_t S = 5, B = 2, n = S * B;
  ModelConfig cfg = tiny_config();
  cfg.add_attention_output_bias = true;
  const int64_t H = cfg.hidden;
  ParamRegistry params{DType::F64};
  ops::RopeTables rope{S, cfg.head_dim(), cfg.rotary_base};
  SelfAttention<double> attn{cfg, params, "attn", rope};
  Arena arena;
  testing::plan_layer(arena, params, 1, [&](Arena& a) { attn.allocate(a, S, B); });
  Param& bias = params.get("attn.linear_proj.bias");
  EXPECT_EQ(bias.spec.global_shape, (std::vector<int64_t>{H}));
  EXPECT_EQ(bias.spec.init, ParamInit::Zeros);
  EXPECT_EQ(bias.spec.kind, ParamKind::Dense);
  EXPECT_FALSE(bias.spec.weight_decay);
  for (int64_t i = 0; i < H; ++i) EXPECT_EQ(host(bias.data_as<double>())[i], 0.0);
  auto x = random_vec<double>(n * H, 2);
  auto R = random_vec<double>(n * H, 3);
  std::vector<double> y(n * H), dx(n * H), y0(n * H);
  attn.forward(y0.data(), x.data());  // zero bias: the model without it
  for (int64_t i = 0; i < H; ++i) host(bias.data_as<double>())[i] = 0.1 * std::cos(i);
  attn.forward(y.data(), x.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_NEAR(y[t * H + h], y0[t * H + h] + 0.1 * std::cos(h), 1e-15) << t << " " << h;
    }
  }
  auto loss = [&] {
    attn.forward(y.data(), x.data());
    return testing::weighted_sum(y.data(), R);
  };
  EXPECT_TRUE(testing::check_layer_gradients(params, loss,
                                             [&] { attn.backward(dx.data(), R.data()); },
                                             {{x.data(), dx.data(), n * H, "dx"}}));
  // The bias gradient is exactly the column sums of dy = R, in row order.
  for (int64_t h = 0; h < H; ++h) {
    double col = 0;
    for (int64_t t = 0; t < n; ++t) col += R[t * H + h];
    EXPECT_NEAR(host(bias.grad_as<double>())[h], col, 1e-14) << h;
  }
}

TEST_F(SelfAttentionTest, IsCausalOverSequence) {
  std::vector<double> y0(n * H), y1(n * H);
  attn.forward(y0.data(), x.data());
  for (int64_t h = 0; h < H; ++h) x[(3 * B + 1) * H + h] += 1.0;  // token s=3, b=1
  attn.forward(y1.data(), x.data());
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      bool may_change = b == 1 && s >= 3;
      for (int64_t h = 0; h < H; ++h) {
        int64_t i = (s * B + b) * H + h;
        if (!may_change) {
          EXPECT_EQ(y0[i], y1[i]) << "s=" << s << " b=" << b;
        }
      }
    }
  }
}

// --bf16: the attention block keeps Megatron-Core's bf16 activations. The QKV GEMM's output,
// RoPE's output and the core's output are rounded to bf16 once each (f32 math inside), and both
// GEMMs read bf16 inputs with f32 accumulation; against that dataflow built from the plain-loop
// references (f64 GEMM sums), on both bf16 GEMM paths. The same dataflow without the three
// roundings is checked to lie outside the tolerance, so a missing rounding point fails.
TEST(SelfAttention, Bf16DataflowRoundsAsMegatron) {
  constexpr int64_t S = 5, B = 2, n = S * B;
  ModelConfig cfg = tiny_config();
  cfg.hidden = 16;
  cfg.bf16 = true;
  const int64_t H = cfg.hidden, Hq = cfg.num_heads, Hkv = cfg.num_query_groups;
  const int64_t D = cfg.head_dim(), C = (Hq + 2 * Hkv) * D;
  auto r16 = [](float v) { return bf16_to_float(float_to_bf16(v)); };
  const std::vector<float> x = random_vec<float>(n * H, 31);
  std::vector<int32_t> pos(n);
  for (int64_t t = 0; t < n; ++t) pos[t] = static_cast<int32_t>(t / B);
  for (bool widened : {false, true}) {
    if (!widened && !ops::bf16_native_available()) {
      std::printf("[ NOT RUN  ] native bf16 path: oneDNN runs below AVX-512 here\n");
      continue;
    }
    SCOPED_TRACE(::testing::Message() << "widened=" << widened);
    const Bf16PathForCopies path(widened);
    ParamRegistry params(DType::F32);
    params.enable_bf16_copies(widened);
    const ops::RopeTables rope(S, D, cfg.rotary_base);
    SelfAttention<float> attn(cfg, params, "attn", rope);
    Arena arena;
    testing::plan_layer(arena, params, 8, [&](Arena& a) { attn.allocate(a, S, B); });
    params.refresh_bf16();
    std::vector<float> y(n * H);
    attn.forward(y.data(), x.data());
    const float* wqkv = host(params.get("attn.linear_qkv.weight").data_as<float>());
    const float* wproj = host(params.get("attn.linear_proj.weight").data_as<float>());
    // y = in w^T over bf16 values, summed in f64; the output rounded to bf16 when asked.
    auto linear = [&](std::vector<float>& out, const std::vector<float>& in, const float* w,
                      int64_t N, int64_t K, bool round) {
      out.assign(n * N, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < N; ++o) {
          double acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += double(r16(in[t * K + i])) * r16(w[o * K + i]);
          out[t * N + o] = round ? r16(float(acc)) : float(acc);
        }
      }
    };
    auto reference = [&](bool round) {
      auto round_all = [&](std::vector<float>& v) {
        if (round)
          for (float& e : v) e = r16(e);
      };
      std::vector<float> qkv, q(n * Hq * D), k(n * Hkv * D), v(n * Hkv * D), qr(q.size()),
          kr(k.size()), out(q.size()), lse(B * Hq * S), yr;
      linear(qkv, x, wqkv, C, H, round);
      ops::split_qkv_ref(q.data(), k.data(), v.data(), qkv.data(), ops::QkvShape{n, Hq, Hkv, D});
      ops::rope_forward_ref(qr.data(), q.data(), pos.data(), n, Hq, D, cfg.rotary_base);
      ops::rope_forward_ref(kr.data(), k.data(), pos.data(), n, Hkv, D, cfg.rotary_base);
      round_all(qr);
      round_all(kr);
      ops::attention_forward_ref(out.data(), lse.data(), qr.data(), kr.data(), v.data(),
                                 ops::AttentionShape{S, B, Hq, Hkv, D}, nullptr);
      round_all(out);
      linear(yr, out, wproj, H, Hq * D, false);
      return yr;
    };
    const std::vector<float> y_ref = reference(true), y_unrounded = reference(false);
    double rms = 0;
    for (float e : y_ref) rms += double(e) * e;
    rms = std::sqrt(rms / double(y_ref.size()));
    ASSERT_GT(rms, 0);
    // f32 sums in the block vs f64 here, and the fast paths vs the references: ~1e-7 of rms;
    // a missing or extra rounding to bf16 moves y by ~2^-9 of rms.
    const double tol = 1e-5 * rms;
    double worst = 0, moved = 0;
    for (int64_t i = 0; i < n * H; ++i) {
      worst = std::max(worst, std::abs(double(y[i]) - y_ref[i]));
      moved = std::max(moved, std::abs(double(y_unrounded[i]) - y_ref[i]));
    }
    EXPECT_LE(worst, tol);
    EXPECT_GT(moved, 10 * tol) << "the roundings do not move y: the test checks nothing";
  }
}

// Every activation, with and without biases (set away from their zero init so they act).
TEST(MLP, FiniteDifferences) {
  const int64_t n = 5, H = 4, F = 3;
  for (ops::Activation act : {ops::Activation::SwiGLU, ops::Activation::GeLU,
                              ops::Activation::GeLUTanh, ops::Activation::SquaredReLU}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << ops::activation_name(act) << " bias=" << bias);
      ParamRegistry params(DType::F64);
      nn::MLP<double> mlp(H, F, act, bias, 0.5, 0.5, params, "mlp");
      EXPECT_EQ(params.params().size(), bias ? 4u : 2u);
      EXPECT_EQ(params.get("mlp.linear_fc1.weight").spec.global_shape,
                (std::vector<int64_t>{ops::activation_fc1_width(act, F), H}));
      Arena arena;
      testing::plan_layer(arena, params, 4, [&](Arena& a) { mlp.allocate(a, n); });
      if (bias) {
        for (const char* name : {"mlp.linear_fc1.bias", "mlp.linear_fc2.bias"}) {
          Param& b = params.get(name);
          EXPECT_FALSE(b.spec.weight_decay) << name;
          auto v = random_vec<double>(b.local_numel(), 9);
          std::copy(v.begin(), v.end(), host(b.data_as<double>()));
        }
      }
      auto x = random_vec<double>(n * H, 5);
      auto R = random_vec<double>(n * H, 6);
      std::vector<double> y(n * H), dx(n * H);
      auto loss = [&] {
        mlp.forward(y.data(), x.data(), n);
        return testing::weighted_sum(y.data(), R);
      };
      EXPECT_TRUE(testing::check_layer_gradients(
          params, loss, [&] { mlp.backward(dx.data(), R.data()); },
          {{x.data(), dx.data(), n * H, "dx"}}));
    }
  }
}

// Recomputing fc1 (with its bias) and the activation in the backward gives bitwise the kept
// forward's gradients, for GeLU with biases: f32, and --bf16 on the native and widened paths.
TEST(MLP, RecomputationIsBitwiseWithGeluAndBiases) {
  const int64_t n = 7, H = 16, F = 24;
  auto x = random_vec<float>(n * H, 15);
  auto dy = random_vec<float>(n * H, 16);
  struct Run {
    std::vector<float> y, dx;
    std::vector<std::vector<float>> grads;
  };
  auto run = [&](bool bf16, bool widened, bool recompute) {
    ParamRegistry params(DType::F32);
    if (bf16) params.enable_bf16_copies(widened);
    nn::MLP<float> mlp(H, F, ops::Activation::GeLU, true, 0.3, 0.2, params, "mlp");
    Arena arena;
    testing::plan_layer(arena, params, 8, [&](Arena& a) { mlp.allocate(a, n, recompute); });
    for (const char* name : {"mlp.linear_fc1.bias", "mlp.linear_fc2.bias"}) {
      Param& b = params.get(name);
      for (int64_t i = 0; i < b.local_numel(); ++i)
        host(b.data_as<float>())[i] = 0.2f * std::cos(float(i));
    }
    params.refresh_bf16();
    EXPECT_EQ(mlp.widened_bf16(), bf16 && widened);
    Run r{std::vector<float>(n * H), std::vector<float>(n * H), {}};
    mlp.forward(r.y.data(), x.data(), n);
    params.zero_grads();
    mlp.backward(r.dx.data(), dy.data());
    for (const Param& p : params.params()) {
      const float* g = host(p.grad_as<float>());
      r.grads.emplace_back(g, g + p.local_numel());
    }
    return r;
  };
  for (auto [bf16, widened] : {std::pair{false, false}, {true, false}, {true, true}}) {
    SCOPED_TRACE(::testing::Message() << "bf16=" << bf16 << " widened=" << widened);
    const Run kept = run(bf16, widened, false), again = run(bf16, widened, true);
    EXPECT_EQ(kept.y, again.y);
    EXPECT_EQ(kept.dx, again.dx);
    ASSERT_EQ(kept.grads.size(), 4u);
    for (size_t i = 0; i < kept.grads.size(); ++i) EXPECT_EQ(kept.grads[i], again.grads[i]) << i;
  }
}

// --bf16 keeps the input norm's output n1 in bf16 and its f32 values in the layer's workspace,
// which the next layer's forward overwrites: the backward refills it. With the bf16 residual
// stream the pre-MLP norm's output n2 too (its f32 values in the block's dnorm workspace; the
// FFN's backward reads them: the router's and the shared expert's weight gradients, a dense
// MLP's). A block's backward after the next layer's forward gives bitwise the gradients of a
// backward right after its own forward, with self-attention and with multi-latent attention,
// dense and MoE layers.
void expect_bf16_norm_output_survives_the_next_layer(bool mla, bool moe) {
  SCOPED_TRACE(mla ? "multi-latent attention" : "self-attention");
  SCOPED_TRACE(moe ? "MoE layers" : "dense layers");
  ModelConfig cfg = tiny_config();
  cfg.hidden = 16;
  cfg.bf16 = true;
  ASSERT_TRUE(cfg.bf16_residual());
  // Two layers of one kind: the same workspace offsets.
  cfg.moe_layer_pattern = moe ? std::vector<int>{1, 1} : std::vector<int>{0, 0};
  if (mla) {
    testing::use_tiny_mla(cfg);
  }
  const int64_t S = 4, B = 2, n = S * B, H = cfg.hidden;
  const ops::RopeTables rope(S, cfg.head_dim(), cfg.rotary_base);
  const ops::RopeMlaTables mla_rope(S, cfg.mla.rope_spec(cfg.rotary_base));
  ParamRegistry params(DType::F32);
  const Bf16PathForCopies path(/*widened=*/true);
  params.enable_bf16_copies(true);
  TransformerBlock<float> b0(cfg, 0, params, rope, nullptr, 0, &mla_rope.cache()),
      b1(cfg, 1, params, rope, nullptr, 0, &mla_rope.cache());
  Arena arena;
  testing::plan_layer(arena, params, 8, [&](Arena& a) {
    b0.allocate(a, S, B);
    b1.allocate(a, S, B);
  });
  params.refresh_bf16();
  const auto x = random_vec<float>(n * H, 41), dy = random_vec<float>(n * H, 42);
  auto grads = [&](bool next_layer_between) {
    std::vector<float> y0(n * H), y1(n * H), dx(n * H);
    params.zero_grads();
    b0.forward(y0.data(), x.data());
    if (next_layer_between) b1.forward(y1.data(), y0.data());
    b0.backward(dx.data(), dy.data(), 1.0);
    std::vector<float> all = dx;
    for (const Param& p : params.params()) {
      if (!p.name().starts_with("decoder.layers.0.")) continue;
      const float* g = host(p.grad_as<float>());
      all.insert(all.end(), g, g + p.local_numel());
    }
    return all;
  };
  const std::vector<float> alone = grads(false), between = grads(true);
  ASSERT_EQ(alone.size(), between.size());
  EXPECT_EQ(alone, between);
}

TEST(TransformerBlock, Bf16KeptNormOutputSurvivesTheNextLayer) {
  for (bool moe : {false, true}) {
    expect_bf16_norm_output_survives_the_next_layer(false, moe);
    expect_bf16_norm_output_survives_the_next_layer(true, moe);
  }
}

TEST(TransformerBlock, FiniteDifferencesDenseAndMoE) {
  ModelConfig cfg = tiny_config();
  const int64_t S = 4, B = 2, n = S * B, H = cfg.hidden;
  const ops::RopeTables rope(S, cfg.head_dim(), cfg.rotary_base);
  for (int64_t layer : {0, 1}) {  // pattern {1, 0}: layer 0 MoE, layer 1 dense
    ParamRegistry params(DType::F64);
    TransformerBlock<double> block(cfg, layer, params, rope);
    EXPECT_EQ(block.is_moe(), layer == 0);
    Arena arena;
    testing::plan_layer(arena, params, 8, [&](Arena& a) { block.allocate(a, S, B); });
    auto x = random_vec<double>(n * H, 9);
    auto R = random_vec<double>(n * H, 10);
    std::vector<double> y(n * H), dx(n * H);
    auto loss = [&] {
      block.forward(y.data(), x.data());
      double l = testing::weighted_sum(y.data(), R);
      if (block.is_moe()) l += block.moe()->router().aux_loss() + block.moe()->router().z_loss();
      return l;
    };
    SCOPED_TRACE(layer == 0 ? "moe block" : "dense block");
    EXPECT_TRUE(testing::check_layer_gradients(
        params, loss, [&] { block.backward(dx.data(), R.data(), 1.0); },
        {{x.data(), dx.data(), n * H, "dx"}}));
  }
}

// Every parameter gradient of (mean CE + aux + z losses) against finite differences.
::testing::AssertionResult check_model_gradients(GPTModel<double>& model,
                                                 const std::vector<int32_t>& ids,
                                                 const std::vector<int32_t>& targets) {
  auto loss = [&] {
    double l = model.forward(ids.data(), targets.data());
    MoeStats st = model.moe_stats();
    return l + st.aux_loss + st.z_loss;
  };
  loss();
  model.params().zero_grads();
  model.backward(1.0);
  return testing::check_param_gradients(model.params(), loss, 16);
}

TEST(GPTModel, FiniteDifferencesEveryParameter) {
  ModelConfig cfg = tiny_config();
  const int64_t B = 2;
  GPTModel<double> model(cfg, B, 1234);
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 1);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 2);
  targets[3] = -1;  // ignored position
  EXPECT_TRUE(check_model_gradients(model, ids, targets));
}

// Multi-latent attention in every layer (q LoRA in both, YaRN with mscale != mscale_all_dim,
// the norms, v narrower than q / k), a MoE and a dense layer, attention dropout: every
// parameter against finite differences; no QKV parameter is built.
TEST(GPTModel, FiniteDifferencesMultiLatentAttention) {
  ModelConfig cfg = tiny_config();
  cfg.qk_layernorm = true;
  cfg.attention_dropout = 0.2;
  testing::use_tiny_mla(cfg);
  cfg.mla.rope_type = ops::RopeType::Yarn;
  cfg.mla.yarn = ops::YarnParams{4.0, 2, 32.0, 1.0, 1.0, 0.8};
  const int64_t B = 2;
  GPTModel<double> model(cfg, B, 4321);
  EXPECT_EQ(model.params().find("decoder.layers.0.self_attention.linear_qkv.weight"), nullptr);
  ASSERT_NE(model.params().find("decoder.layers.1.self_attention.linear_kv_up_proj.weight"),
            nullptr);
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 5);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 6);
  EXPECT_TRUE(check_model_gradients(model, ids, targets));
}

// Tied embeddings (head gradient adds into the embedding), QKV bias and qk-layernorm.
TEST(GPTModel, FiniteDifferencesTiedQkvBiasQkLayernorm) {
  ModelConfig cfg = tiny_config();
  cfg.tie_embeddings = true;
  cfg.add_qkv_bias = true;
  cfg.qk_layernorm = true;
  const int64_t B = 2;
  GPTModel<double> model(cfg, B, 77);
  EXPECT_EQ(model.params().find("output_layer.weight"), nullptr);
  ASSERT_NE(model.params().find("decoder.layers.1.self_attention.linear_qkv.bias"), nullptr);
  ASSERT_NE(model.params().find("decoder.layers.0.self_attention.k_layernorm.weight"), nullptr);
  // Non-zero biases so their gradient path is exercised away from the zero init.
  Param& bias = model.params().get("decoder.layers.0.self_attention.linear_qkv.bias");
  for (int64_t i = 0; i < bias.local_numel(); ++i)
    host(bias.data_as<double>())[i] = 0.1 * std::sin(i);
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 3);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 4);
  EXPECT_TRUE(check_model_gradients(model, ids, targets));
}

// Megatron's default model: LayerNorm (also its 1p form), learned absolute positions, GeLU
// MLPs, biases on every linear layer, dropout on the embeddings, after attention and the MLP /
// MoE, and on the attention probabilities. The masks are a pure function of the counters, so
// the loss is a function of the parameters and every gradient checks against finite
// differences, dropout included.
TEST(GPTModel, FiniteDifferencesMegatronDefaultModelWithDropout) {
  for (bool one_p : {false, true}) {
    SCOPED_TRACE(one_p ? "apply-layernorm-1p" : "LayerNorm");
    ModelConfig cfg = tiny_config();
    cfg.normalization = Normalization::LayerNorm;
    cfg.layernorm_1p = one_p;
    cfg.position_embedding = PositionEmbedding::LearnedAbsolute;
    cfg.activation = ops::Activation::GeLU;
    cfg.add_mlp_bias = cfg.add_qkv_bias = cfg.add_attention_output_bias = true;
    cfg.hidden_dropout = 0.2;
    cfg.attention_dropout = 0.3;
    const int64_t B = 2;
    GPTModel<double> model(cfg, B, 5);
    ASSERT_NE(model.params().find("embedding.position_embeddings.weight"), nullptr);
    ASSERT_NE(model.params().find("decoder.final_layernorm.bias"), nullptr);
    ASSERT_NE(model.params().find("decoder.layers.0.input_layernorm.bias"), nullptr);
    // Biases and LayerNorm shifts away from their zero init, so their paths carry gradient.
    for (Param& p : model.params().params()) {
      if (p.spec.init != ParamInit::Normal) {
        for (int64_t i = 0; i < p.local_numel(); ++i)
          host(p.data_as<double>())[i] += 0.1 * std::sin(3.0 * i + 1);
      }
    }
    auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 8);
    auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 9);
    EXPECT_TRUE(check_model_gradients(model, ids, targets));
  }
}

// Evaluation never drops: in eval mode two forwards are bitwise equal and equal to the same
// model built without dropout; training forwards drop (another loss).
TEST(GPTModel, EvalForwardsNeverDrop) {
  ModelConfig cfg = tiny_config();
  cfg.hidden_dropout = 0.1;
  cfg.attention_dropout = 0.1;
  ModelConfig plain = cfg;
  plain.hidden_dropout = plain.attention_dropout = 0;
  const int64_t B = 2;
  GPTModel<double> model(cfg, B, 21), reference(plain, B, 21);
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 10);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 11);
  const double train_loss = model.forward(ids.data(), targets.data());
  model.set_training(false);
  reference.set_training(false);
  const double a = model.forward(ids.data(), targets.data());
  const double b = model.forward(ids.data(), targets.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, reference.forward(ids.data(), targets.data()));
  EXPECT_NE(train_loss, a);
}

// Qwen-style options: the shared expert's gate (--moe-shared-expert-gate) and the attention
// output bias (--add-attention-output-bias) with the QKV bias; every parameter, gate_weight and
// linear_proj.bias included, against finite differences.
TEST(GPTModel, FiniteDifferencesSharedExpertGateAndAttentionOutputBias) {
  ModelConfig cfg = tiny_config();
  cfg.moe_layer_pattern = {1, 1};
  cfg.moe.shared_expert_gate = true;
  cfg.add_qkv_bias = true;
  cfg.add_attention_output_bias = true;
  const int64_t B = 2;
  GPTModel<double> model(cfg, B, 78);
  for (int layer : {0, 1}) {
    ASSERT_NE(
        model.params().find(fmt::format("decoder.layers.{}.mlp.shared_experts.gate_weight", layer)),
        nullptr);
    Param& bias =
        model.params().get(fmt::format("decoder.layers.{}.self_attention.linear_proj.bias", layer));
    for (int64_t i = 0; i < bias.local_numel(); ++i)
      host(bias.data_as<double>())[i] = 0.1 * std::sin(i + layer);
  }
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 5);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 6);
  EXPECT_TRUE(check_model_gradients(model, ids, targets));
}

// Megatron's default MLP: GeLU (and its tanh form) with fc1 / fc2 biases in the dense layer, the
// experts and the shared expert; every parameter against finite differences, the biases set
// away from their zero init.
TEST(GPTModel, FiniteDifferencesGeluWithMlpBiases) {
  for (ops::Activation act : {ops::Activation::GeLU, ops::Activation::GeLUTanh}) {
    SCOPED_TRACE(ops::activation_name(act));
    ModelConfig cfg = tiny_config();
    cfg.activation = act;
    cfg.add_mlp_bias = true;
    const int64_t B = 2;
    GPTModel<double> model(cfg, B, 79);
    int biases = 0;
    for (const char* name :
         {"decoder.layers.0.mlp.experts.linear_fc1.bias", "decoder.layers.0.mlp.experts.linear_fc2.bias",
          "decoder.layers.0.mlp.shared_experts.linear_fc1.bias",
          "decoder.layers.0.mlp.shared_experts.linear_fc2.bias", "decoder.layers.1.mlp.linear_fc1.bias",
          "decoder.layers.1.mlp.linear_fc2.bias"}) {
      Param& b = model.params().get(name);
      for (int64_t i = 0; i < b.local_numel(); ++i)
        host(b.data_as<double>())[i] = 0.1 * std::sin(i + biases);
      ++biases;
    }
    EXPECT_EQ(model.params().get("decoder.layers.0.mlp.experts.linear_fc1.bias").spec.global_shape,
              (std::vector<int64_t>{cfg.num_experts, cfg.moe.ffn_hidden}));
    EXPECT_EQ(model.params().get("decoder.layers.1.mlp.linear_fc1.weight").spec.global_shape,
              (std::vector<int64_t>{cfg.ffn_hidden, cfg.hidden}));
    auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 9);
    auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 10);
    EXPECT_TRUE(check_model_gradients(model, ids, targets));
  }
}

// A tiny f32 GeLU model with MLP biases learns: plain SGD steps (lr 0.1) on one batch lower its
// loss, and the biases move away from zero. Without aux and z losses the gradient is the
// reported loss's.
TEST(GPTModel, GeluWithMlpBiasesLossFallsUnderSgd) {
  ModelConfig cfg = tiny_config();
  cfg.activation = ops::Activation::GeLU;
  cfg.add_mlp_bias = true;
  cfg.moe.router.aux_loss_coeff = 0;
  cfg.moe.router.z_loss_coeff = 0;
  cfg.hidden = 16;
  cfg.init_std = 0.1;
  const int64_t B = 4;
  GPTModel<float> model(cfg, B, 80);
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 11);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 12);
  std::vector<double> losses;
  for (int step = 0; step < 8; ++step) {
    losses.push_back(model.forward(ids.data(), targets.data()));
    model.params().zero_grads();
    model.backward(1.0);
    for (Param& p : model.params().params()) {
      float* w = host(p.data_as<float>());
      const float* g = host(p.grad_as<float>());
      for (int64_t i = 0; i < p.local_numel(); ++i) w[i] -= 0.1f * g[i];
    }
  }
  // Routing choices may flip between steps (the loss is only piecewise smooth in the weights),
  // so no step-by-step monotonicity: every step below the start, the last well below it.
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[0]) << "step " << i;
  EXPECT_LT(losses.back(), 0.8 * losses.front());
  const Param& b = model.params().get("decoder.layers.1.mlp.linear_fc2.bias");
  double norm = 0;
  for (int64_t i = 0; i < b.local_numel(); ++i) norm += std::abs(host(b.data_as<float>())[i]);
  EXPECT_GT(norm, 0.0);
}

// Without the options no parameter is added: the model of the main line.
TEST(GPTModel, NoGateOrOutputBiasByDefault) {
  ModelConfig cfg = tiny_config();
  GPTModel<double> model(cfg, 2, 78);
  for (const Param& p : model.params().params()) {
    EXPECT_EQ(p.name().find("gate_weight"), std::string::npos) << p.name();
    EXPECT_EQ(p.name().find("linear_proj.bias"), std::string::npos) << p.name();
  }
}

// A gate without a shared expert is refused, naming both flags.
TEST(ModelConfig, SharedExpertGateNeedsASharedExpert) {
  ModelConfig cfg = tiny_config();
  cfg.moe.shared_expert_gate = true;
  EXPECT_NO_THROW(cfg.validate());
  cfg.moe.shared_ffn_hidden = 0;
  const std::string msg = testing::error_of([&] { cfg.validate(); });
  EXPECT_NE(msg.find("--moe-shared-expert-gate"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--moe-shared-expert-intermediate-size"), std::string::npos) << msg;
}

// The step's path: forward(io) writes each micro-batch's results into its report slot (whatever
// the slot held before) and backward takes 1 / counted from that slot. Two micro-batches with
// different counted tokens, two MoE layers that drop: the slots hold exactly what the host
// path returns and the routers report, and the gradients are bitwise those of the host path.
TEST(GPTModel, StepReportHoldsEachMicroBatchsResults) {
  ModelConfig cfg = tiny_config();
  cfg.moe_layer_pattern = {1, 1};
  cfg.moe.router.capacity_factor = 0.5;  // drops
  const int64_t B = 2, n = B * cfg.seq_length, E = cfg.num_experts;
  GPTModel<double> step(cfg, B, 5), host(cfg, B, 5);
  std::vector<std::vector<int32_t>> ids, targets;
  for (uint32_t mb = 0; mb < 2; ++mb) {
    ids.push_back(random_ids(n, cfg.vocab_size, 10 + mb));
    targets.push_back(random_ids(n, cfg.vocab_size, 20 + mb));
  }
  targets[1][0] = targets[1][7] = -1;  // micro-batch 1 counts 8 of 10 tokens
  std::vector<ops::MicroBatchReport> report(2);
  std::vector<int64_t> tokens(2 * E);
  std::memset(static_cast<void*>(report.data()), 0xff, sizeof(ops::MicroBatchReport) * 2);  // stale
  std::fill(tokens.begin(), tokens.end(), -3);
  step.params().zero_grads();
  host.params().zero_grads();
  for (int mb = 0; mb < 2; ++mb) {
    SCOPED_TRACE(::testing::Message() << "micro-batch " << mb);
    step.forward(MicroBatchIO{ids[mb].data(), targets[mb].data(), &report[mb], &tokens[mb * E]});
    step.backward(0.5);
    const double loss = host.forward(ids[mb].data(), targets[mb].data());
    const MoeStats st = host.moe_stats();
    host.backward(0.5);
    const ops::MicroBatchReport& r = report[mb];
    EXPECT_EQ(r.counted, mb == 0 ? 10 : 8);
    EXPECT_EQ(GPTModel<double>::mean_loss(r), loss);
    EXPECT_EQ(r.moe_layers, 2);
    EXPECT_EQ(r.aux_value, st.aux_value);
    EXPECT_EQ(r.z_value, st.z_value);
    EXPECT_EQ(r.dropped, st.dropped);
    EXPECT_GT(r.dropped, 0) << "the case must drop";
    EXPECT_EQ(std::vector<int64_t>(tokens.begin() + mb * E, tokens.begin() + (mb + 1) * E),
              st.tokens_per_expert);
  }
  for (size_t k = 0; k < step.params().params().size(); ++k) {
    const Param& a = step.params().params()[k];
    const Param& b = host.params().params()[k];
    EXPECT_EQ(
        std::memcmp(testing::host(a.grad), testing::host(b.grad), sizeof(double) * a.local_numel()),
        0)
        << a.spec.name;
  }
}

// Pipeline chunks in one process: a first stage (embedding, layers 0-1) and a last stage
// (layers 2-3, loss; with tied embeddings its own copy of the table) compose to the whole model:
// the same loss and report, every gradient bitwise (the tied table's within f64 ulps: the two
// stages' parts added once instead of per micro-batch), over two micro-batches run in 1F1B's
// order for the first stage: F0 F1 B0 B1, so micro-batch 0's backward needs its forward
// recomputed (replay) first, with dropout and router jitter on.
void expect_chunks_compose(bool tied) {
  ModelConfig cfg = tiny_config();
  cfg.num_layers = 4;
  cfg.moe_layer_pattern = {1, 0, 1, 1};
  cfg.tie_embeddings = tied;
  cfg.hidden_dropout = 0.2;
  cfg.attention_dropout = 0.1;
  cfg.moe.router.input_jitter_eps = 0.05;
  const int64_t B = 2, n = B * cfg.seq_length, E = cfg.num_experts;
  GPTModel<double> whole(cfg, B, 7);
  GPTModel<double> first(cfg, B, 7, nullptr, false, cpu_exec(),
                         {parallel::VirtualStage{0, 2, 0, true, false}});
  GPTModel<double> last(cfg, B, 7, nullptr, false, cpu_exec(),
                        {parallel::VirtualStage{2, 2, 0, false, true}});
  EXPECT_EQ(last.tied_table() != nullptr, tied);
  const testing::StageReports reports = testing::run_whole_and_two_stages(
      whole, first, last, testing::two_micro_batches(n, cfg.vocab_size), E);
  const auto &rw = reports.whole, &rf = reports.first, &rl = reports.last;
  for (int mb = 0; mb < 2; ++mb) {
    EXPECT_EQ(rl[mb].lm_loss_sum, rw[mb].lm_loss_sum) << mb;
    EXPECT_EQ(rl[mb].counted, rw[mb].counted) << mb;
    EXPECT_EQ(rf[mb].moe_layers + rl[mb].moe_layers, rw[mb].moe_layers) << mb;
    EXPECT_NEAR(rf[mb].aux_value + rl[mb].aux_value, rw[mb].aux_value,
                1e-15 * std::abs(rw[mb].aux_value)) << mb;
  }
  int compared = 0;
  for (const Param& w : whole.params().params()) {
    const ParamRegistry& reg = first.params().find(w.name()) != nullptr ? first.params()
                                                                         : last.params();
    const Param* a = reg.find(w.name());
    ASSERT_NE(a, nullptr) << w.name() << " is on no stage";
    const double* gw = host(w.grad_as<double>());
    const double* ga = host(a->grad_as<double>());
    if (tied && w.name() == "embedding.word_embeddings.weight") {
      const double* gb = host(last.params().find(w.name())->grad_as<double>());
      for (int64_t i = 0; i < w.local_numel(); ++i)
        EXPECT_NEAR(ga[i] + gb[i], gw[i], 1e-14 * (std::abs(gw[i]) + 1e-3)) << w.name() << i;
    } else {
      EXPECT_EQ(std::memcmp(ga, gw, sizeof(double) * w.local_numel()), 0) << w.name();
    }
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(whole.params().params().size()));
}

TEST(GPTModel, PipelineChunksComposeToTheWholeModel) { expect_chunks_compose(false); }
TEST(GPTModel, PipelineChunksComposeToTheWholeModelTied) { expect_chunks_compose(true); }

TEST(GPTModel, F32MatchesF64AndIsDeterministic) {
  ModelConfig cfg = tiny_config();
  cfg.init_std = 0.02;
  GPTModel<double> m64(cfg, 3, 99);
  GPTModel<float> m32(cfg, 3, 99);
  auto ids = random_ids(3 * cfg.seq_length, cfg.vocab_size, 4);
  auto targets = random_ids(3 * cfg.seq_length, cfg.vocab_size, 5);
  double l64 = m64.forward(ids.data(), targets.data());
  double l32 = m32.forward(ids.data(), targets.data());
  EXPECT_NEAR(l32, l64, testing::kF32Rtol * std::abs(l64));
  EXPECT_NEAR(l64, std::log(11.0), 0.05);  // small init: near-uniform predictions
  EXPECT_EQ(m32.forward(ids.data(), targets.data()), l32);
  // Same seed, same global model regardless of dtype: the embedding matches to f32 rounding.
  const double* w64 = host(m64.params().get("embedding.word_embeddings.weight").data_as<double>());
  const float* w32 = host(m32.params().get("embedding.word_embeddings.weight").data_as<float>());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(w32[i], static_cast<float>(w64[i]));
}

// The production f32 model (oneDNN GEMMs, the vectorised attention / softmax / SwiGLU paths,
// fast_exp, several threads) against the f64 model (reference GEMM loops) on the same weights
// (the f32 ones widened) and batch: the loss and every parameter gradient, per tensor, within
// the f32-vs-f64 rows of docs/numerics.md. The routing must be the same in both (compared
// below): a flipped top-k choice would be a different function, not a rounding error.
TEST(GPTModel, F32GradientsMatchF64OnTheSameWeights) {
  ModelConfig cfg = tiny_config();
  cfg.hidden = 32;
  cfg.init_std = 0.1;
  const int64_t B = 3;
  testing::ScopedOmpThreads threads(3);
  GPTModel<float> m32(cfg, B, 21);
  GPTModel<double> m64(cfg, B, 21);
  for (const Param& p : m32.params().params()) {
    const Param& q = m64.params().get(p.name());
    for (int64_t i = 0; i < p.local_numel(); ++i) {
      host(q.data_as<double>())[i] = static_cast<double>(host(p.data_as<float>())[i]);
    }
  }
  auto ids = random_ids(B * cfg.seq_length, cfg.vocab_size, 8);
  auto targets = random_ids(B * cfg.seq_length, cfg.vocab_size, 9);
  targets[4] = -1;
  const double l32 = m32.forward(ids.data(), targets.data());
  const double l64 = m64.forward(ids.data(), targets.data());
  const MoeStats s32 = m32.moe_stats(), s64 = m64.moe_stats();
  ASSERT_EQ(s32.layers.size(), s64.layers.size());
  for (size_t i = 0; i < s32.layers.size(); ++i) {
    ASSERT_EQ(s32.layers[i].router.tokens_per_expert, s64.layers[i].router.tokens_per_expert)
        << "routing differs between f32 and f64 in MoE layer " << s32.layers[i].layer;
  }
  const double loss32 = l32 + s32.aux_loss + s32.z_loss, loss64 = l64 + s64.aux_loss + s64.z_loss;
  EXPECT_NEAR(loss32, loss64, testing::kF32ModelLossRtol * std::abs(loss64));
  m32.params().zero_grads();
  m64.params().zero_grads();
  m32.backward(1.0);
  m64.backward(1.0);
  double worst_rel = 0, worst_elem = 0;
  for (const Param& p : m64.params().params()) {
    const Param& q = m32.params().get(p.name());
    const double* g64 = host(p.grad_as<double>());
    const float* g32 = host(q.grad_as<float>());
    const int64_t n = p.local_numel();
    double diff = 0, ref = 0;
    for (int64_t i = 0; i < n; ++i) {
      diff += (g32[i] - g64[i]) * (g32[i] - g64[i]);
      ref += g64[i] * g64[i];
    }
    ASSERT_GT(ref, 0) << p.name() << ": a zero gradient checks nothing";
    const double rel = std::sqrt(diff / ref), rms = std::sqrt(ref / n);
    double elem = 0;  // max_i |g32 - g64| / rms(g64)
    for (int64_t i = 0; i < n; ++i) elem = std::max(elem, std::abs(g32[i] - g64[i]) / rms);
    worst_rel = std::max(worst_rel, rel);
    worst_elem = std::max(worst_elem, elem);
    EXPECT_LE(rel, testing::kF32ModelGradRelNorm) << p.name();
    EXPECT_TRUE(testing::all_close(g32, g64, n, testing::kF32ModelGradRtol,
                                   testing::kF32ModelGradAtolPerRms * rms))
        << p.name();
  }
  // The measured values behind the tolerances (docs/numerics.md), for re-measuring.
  std::printf("f32 vs f64: loss %.3g relative, gradients <= %.3g relative norm, max |diff| <= "
              "%.3g * rms\n",
              std::abs(loss32 - loss64) / std::abs(loss64), worst_rel, worst_elem);
}

// --bf16 runs the same model with bf16 GEMM inputs: loss and every gradient stay close to the
// f32 model's (docs/numerics.md, bf16 rows), and the bf16 copies track the masters.
void expect_bf16_tracks_f32(ModelConfig cfg) {
  cfg.hidden = 32;
  cfg.init_std = 0.1;
  ModelConfig cfg16 = cfg;
  cfg16.bf16 = true;
  GPTModel<float> m32(cfg, 3, 5), m16(cfg16, 3, 5);
  // Non-zero MLP biases (they start at zero), the same in both models.
  for (const Param& p : m32.params().params()) {
    if (!p.name().ends_with("linear_fc1.bias") && !p.name().ends_with("linear_fc2.bias")) continue;
    const Param& q = m16.params().get(p.name());
    for (int64_t i = 0; i < p.local_numel(); ++i)
      host(p.data_as<float>())[i] = host(q.data_as<float>())[i] = 0.1f * std::sin(float(i));
  }
  m16.params().refresh_bf16();  // the copies follow their masters (the check below)
  auto ids = random_ids(3 * cfg.seq_length, cfg.vocab_size, 6);
  auto targets = random_ids(3 * cfg.seq_length, cfg.vocab_size, 7);
  double l32 = m32.forward(ids.data(), targets.data());
  double l16 = m16.forward(ids.data(), targets.data());
  EXPECT_NEAR(l16, l32, testing::kBf16LossRtol * l32);
  m32.params().zero_grads();
  m16.params().zero_grads();
  m32.backward(1.0);
  m16.backward(1.0);
  double worst = 0;
  for (const Param& p : m32.params().params()) {
    const Param& q = m16.params().get(p.name());
    double diff = 0, ref = 0;
    for (int64_t i = 0; i < p.local_numel(); ++i) {
      double a = host(p.grad_as<float>())[i], b = host(q.grad_as<float>())[i];
      diff += (a - b) * (a - b);
      ref += a * a;
    }
    EXPECT_LE(std::sqrt(diff), testing::kBf16GradRelNorm * std::sqrt(ref)) << p.name();
    if (ref > 0) worst = std::max(worst, std::sqrt(diff / ref));
    // The bf16 copy (bf16, or widened to f32 on the widen GEMM path) is the master rounded to
    // nearest even.
    ASSERT_TRUE(q.data16 != nullptr || q.data16w != nullptr) << q.name();
    for (int64_t i = 0; i < std::min<int64_t>(q.local_numel(), 16); ++i) {
      const bf16 expect = float_to_bf16(host(q.data_as<float>())[i]);
      if (q.data16 != nullptr) {
        EXPECT_EQ(host(q.data16)[i].bits, expect.bits) << q.name();
      }
      if (q.data16w != nullptr) {
        EXPECT_EQ(host(q.data16w)[i], bf16_to_float(expect)) << q.name();
      }
    }
  }
  EXPECT_EQ(m32.params().get("output_layer.weight").data16, nullptr);
  EXPECT_EQ(m32.params().get("output_layer.weight").data16w, nullptr);
  // The measured values behind the rows (docs/numerics.md), for re-measuring.
  std::printf("bf16 vs f32: loss %.3g relative, gradients <= %.3g relative norm\n",
              std::abs(l16 - l32) / std::abs(l32), worst);
}

TEST(GPTModel, Bf16MixedPrecisionTracksF32) { expect_bf16_tracks_f32(tiny_config()); }

// --fp32-residual-connection: the same with the residual stream kept in f32.
TEST(GPTModel, Bf16MixedPrecisionTracksF32Fp32ResidualConnection) {
  ModelConfig cfg = tiny_config();
  cfg.fp32_residual_connection = true;
  expect_bf16_tracks_f32(cfg);
}

// The same for the element-wise activations with MLP biases (dense, experts, shared expert),
// on both bf16 GEMM paths: the biases stay f32, their gradients summed from f32 values.
TEST(GPTModel, Bf16MixedPrecisionTracksF32GeluWithMlpBiases) {
  for (ops::Bf16GemmPath path : testing::runnable_bf16_gemm_paths()) {
    testing::ScopedBf16GemmPath scope(path);
    for (ops::Activation act : {ops::Activation::GeLU, ops::Activation::SquaredReLU}) {
      SCOPED_TRACE(::testing::Message() << ops::bf16_gemm_path_name(path) << " "
                                        << ops::activation_name(act));
      ModelConfig cfg = tiny_config();
      cfg.activation = act;
      cfg.add_mlp_bias = true;
      expect_bf16_tracks_f32(cfg);
    }
  }
}

// Multi-latent attention under --bf16, on both bf16 GEMM paths: with q LoRA and the latents'
// norms, v narrower than q / k (linear_proj over padded heads as column blocks), YaRN; and
// linear_q_proj with v wider than q / k. Every projection takes bf16 inputs (the kv down
// projection's two row blocks, the blocks' GEMMs, the input gradient added over the q and kv
// paths), the norms and the rotary stay f32.
TEST(GPTModel, Bf16MixedPrecisionTracksF32MultiLatentAttention) {
  for (ops::Bf16GemmPath path : testing::runnable_bf16_gemm_paths()) {
    testing::ScopedBf16GemmPath scope(path);
    for (const bool lora : {true, false}) {
      SCOPED_TRACE(::testing::Message() << ops::bf16_gemm_path_name(path)
                                        << (lora ? " q LoRA, dv < qk + pe" : " q proj, dv > qk + pe"));
      ModelConfig cfg = tiny_config();
      cfg.multi_latent_attention = true;
      cfg.qk_layernorm = true;
      cfg.mla.q_lora_rank = lora ? 12 : 0;
      cfg.mla.kv_lora_rank = 10;
      cfg.mla.qk_head_dim = 6;
      cfg.mla.qk_pos_emb_head_dim = 4;
      cfg.mla.v_head_dim = lora ? 8 : 12;
      cfg.mla.rope_type = ops::RopeType::Yarn;
      cfg.mla.yarn = ops::YarnParams{4.0, 2, 32.0, 1.0, 1.0, 0.8};
      expect_bf16_tracks_f32(cfg);
    }
  }
}

// The cross entropy that forward_logits' [B, S, V] logits imply (on the host, in f64) and the
// loss forward() computes with its fused head on the same batch; whether the routers saw eval
// mode during forward_logits and training mode in the forward() after it.
template <typename T>
void logits_and_loss(const ModelConfig& cfg, int64_t B, double* implied, double* fused,
                     bool* eval_inside, bool* training_after) {
  GPTModel<T> model(cfg, B, 321);
  const int64_t S = cfg.seq_length, V = cfg.vocab_size;
  auto ids = random_ids(B * S, V, 7);
  auto targets = random_ids(B * S, V, 8);
  targets[2] = targets[S + 4] = -1;  // ignored positions, one in each sequence
  std::vector<T> logits(B * S * V);
  model.forward_logits(ids.data(), logits.data());
  *eval_inside = !model.routers().front()->saved().training;
  double sum = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < B * S; ++i) {  // i = b * S + s, as the ids
    if (targets[i] < 0) continue;
    const T* z = logits.data() + i * V;
    double mx = z[0], se = 0;
    for (int64_t v = 1; v < V; ++v) mx = std::max<double>(mx, z[v]);
    for (int64_t v = 0; v < V; ++v) se += std::exp(static_cast<double>(z[v]) - mx);
    sum += mx + std::log(se) - static_cast<double>(z[targets[i]]);
    ++counted;
  }
  *implied = sum / static_cast<double>(counted);
  *fused = model.forward(ids.data(), targets.data());
  *training_after = model.routers().front()->saved().training;
}

// forward_logits is forward() with the head as a plain GEMM: the loss its logits imply is the
// fused head's loss, to summation order (f64: kF64Rtol; f32: kF32Rtol), with B = 2 so the
// batch-major rows of sequence-major tokens are exercised; the routers run in eval mode inside
// it and are back in training mode after.
TEST(GPTModel, ForwardLogitsImplyTheFusedHeadsLoss) {
  ModelConfig cfg = tiny_config();
  cfg.moe_layer_pattern = {1, 1};
  double implied = 0, fused = 0;
  bool eval_inside = false, training_after = false;
  logits_and_loss<double>(cfg, 2, &implied, &fused, &eval_inside, &training_after);
  EXPECT_NEAR(implied, fused, testing::kF64Rtol * fused);
  EXPECT_TRUE(eval_inside);
  EXPECT_TRUE(training_after);
  logits_and_loss<float>(cfg, 2, &implied, &fused, &eval_inside, &training_after);
  EXPECT_NEAR(implied, fused, testing::kF32Rtol * fused);
  cfg.tie_embeddings = true;  // the head is the embedding
  logits_and_loss<double>(cfg, 3, &implied, &fused, &eval_inside, &training_after);
  EXPECT_NEAR(implied, fused, testing::kF64Rtol * fused);
}

// --bf16: forward_logits' head GEMMs take the same bf16 inputs as the fused head's, on either
// bf16 GEMM path, so the loss they imply is the fused loss to summation order (kF32Rtol), tied
// and untied.
TEST(GPTModel, ForwardLogitsUnderBf16ImplyTheFusedHeadsLoss) {
  for (ops::Bf16GemmPath path :
       testing::runnable_bf16_gemm_paths({ops::Bf16GemmPath::Widen, ops::Bf16GemmPath::Native})) {
    testing::ScopedBf16GemmPath scope(path);
    for (bool tie : {false, true}) {
      SCOPED_TRACE(std::string(ops::bf16_gemm_path_name(path)) + (tie ? " tied" : " untied"));
      ModelConfig cfg = tiny_config();
      cfg.moe_layer_pattern = {1, 1};
      cfg.bf16 = true;
      cfg.tie_embeddings = tie;
      double implied = 0, fused = 0;
      bool eval_inside = false, training_after = false;
      logits_and_loss<float>(cfg, 2, &implied, &fused, &eval_inside, &training_after);
      EXPECT_NEAR(implied, fused, testing::kF32Rtol * fused);
    }
  }
}

// One rank, the tables padded from 11 to 16 rows: the padding is not part of the model. The
// padded rows start at zero and get no gradient; the loss, the model rows' gradients of the
// embedding and the head, every other gradient and forward_logits' [B, S, V] are bitwise the
// unpadded model's, tied and untied, f64 and f32, and --bf16 on both GEMM paths.
template <typename T>
void expect_padding_changes_nothing(ModelConfig cfg) {
  const int64_t B = 2, S = cfg.seq_length, V = cfg.vocab_size, H = cfg.hidden;
  ModelConfig padded = cfg;
  padded.padded_vocab_size = 16;
  GPTModel<T> a(cfg, B, 77), b(padded, B, 77);
  const auto ids = random_ids(B * S, V, 3);
  auto targets = random_ids(B * S, V, 4);
  targets[1] = -1;
  targets[B * S - 1] = int32_t(V - 1);  // the last model row
  EXPECT_EQ(a.forward(ids.data(), targets.data()), b.forward(ids.data(), targets.data()));
  a.backward(0.5);
  b.backward(0.5);
  for (size_t i = 0; i < a.params().params().size(); ++i) {
    const Param& pa = a.params().params()[i];
    const Param& pb = b.params().params()[i];
    ASSERT_EQ(pa.name(), pb.name());
    const bool vocab = pb.local_numel() != pa.local_numel();
    if (vocab) {
      ASSERT_EQ(pb.local_numel(), 16 * H) << pb.name();
      EXPECT_EQ(pb.spec.model_rows, V) << pb.name();
    }
    const T* wa = host(pa.data_as<T>());
    const T* wb = host(pb.data_as<T>());
    const T* ga = host(pa.grad_as<T>());
    const T* gb = host(pb.grad_as<T>());
    for (int64_t j = 0; j < pa.local_numel(); ++j) {
      ASSERT_EQ(wb[j], wa[j]) << pb.name() << " value " << j;
      ASSERT_EQ(gb[j], ga[j]) << pb.name() << " gradient " << j;
    }
    for (int64_t j = pa.local_numel(); j < pb.local_numel(); ++j) {
      ASSERT_EQ(wb[j], T(0)) << pb.name() << " padding value " << j;
      ASSERT_EQ(gb[j], T(0)) << pb.name() << " padding gradient " << j;
    }
  }
  std::vector<T> la(B * S * V), lb(B * S * V + 1, T(-7));  // one guard element past [B, S, V]
  a.forward_logits(ids.data(), la.data());
  b.forward_logits(ids.data(), lb.data());
  for (int64_t j = 0; j < B * S * V; ++j) ASSERT_EQ(lb[j], la[j]) << "logit " << j;
  EXPECT_EQ(lb[B * S * V], T(-7)) << "forward_logits wrote past [B, S, V]";
}

TEST(GPTModel, VocabularyPaddingChangesNothing) {
  for (bool tie : {false, true}) {
    SCOPED_TRACE(tie ? "tied" : "untied");
    ModelConfig cfg = tiny_config();
    cfg.tie_embeddings = tie;
    expect_padding_changes_nothing<double>(cfg);
    expect_padding_changes_nothing<float>(cfg);
    cfg.bf16 = true;
    for (ops::Bf16GemmPath path : testing::runnable_bf16_gemm_paths(
             {ops::Bf16GemmPath::Widen, ops::Bf16GemmPath::Native})) {
      SCOPED_TRACE(ops::bf16_gemm_path_name(path));
      testing::ScopedBf16GemmPath scope(path);
      expect_padding_changes_nothing<float>(cfg);
    }
  }
}

TEST(GPTModel, ParameterNamesAndKinds) {
  ModelConfig cfg = tiny_config();
  GPTModel<float> model(cfg, 1, 1);
  const auto& p = model.params();
  ASSERT_NE(p.find("decoder.layers.0.mlp.router.weight"), nullptr);
  ASSERT_NE(p.find("decoder.layers.0.mlp.experts.linear_fc1.weight"), nullptr);
  ASSERT_NE(p.find("decoder.layers.0.mlp.shared_experts.linear_fc2.weight"), nullptr);
  ASSERT_NE(p.find("decoder.layers.1.mlp.linear_fc1.weight"), nullptr);
  EXPECT_EQ(p.find("decoder.layers.1.mlp.router.weight"), nullptr);
  EXPECT_EQ(p.find("decoder.layers.0.mlp.experts.linear_fc1.weight")->spec.kind, ParamKind::Expert);
  EXPECT_FALSE(p.find("decoder.final_layernorm.weight")->spec.weight_decay);
  EXPECT_EQ(p.find("decoder.layers.0.self_attention.linear_qkv.weight")->spec.global_shape,
            (std::vector<int64_t>{(4 + 2 * 2) * 2, 8}));
}

TEST(Config, MoeLayerFreqPatterns) {
  EXPECT_EQ(parse_moe_layer_freq("1", 3), (std::vector<int>{1, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("2", 5), (std::vector<int>{1, 0, 1, 0, 1}));
  EXPECT_EQ(parse_moe_layer_freq("([0]*3+[1]*2)", 5), (std::vector<int>{0, 0, 0, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("[1, 0, 1]", 3), (std::vector<int>{1, 0, 1}));
  EXPECT_THROW(parse_moe_layer_freq("[1,0]", 3), Error);
  EXPECT_THROW(parse_moe_layer_freq("[2,0]", 2), Error);
  EXPECT_THROW(parse_moe_layer_freq("0", 2), Error);
}

TEST(Config, ValidationNamesTheValues) {
  auto expect_error = [](ModelConfig cfg, const std::string& needle) {
    try {
      cfg.validate();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ModelConfig cfg = tiny_config();
  EXPECT_NO_THROW(cfg.validate());
  ModelConfig c1 = cfg;
  c1.num_heads = 3;
  expect_error(c1, "--num-attention-heads=3");
  ModelConfig c2 = cfg;
  c2.num_query_groups = 3;
  expect_error(c2, "--num-query-groups=3");
  ModelConfig c3 = cfg;
  c3.moe.router.topk = 5;
  expect_error(c3, "--moe-router-topk=5");
  ModelConfig c4 = cfg;
  c4.moe_layer_pattern = {1, 0, 1};
  expect_error(c4, "--num-layers=2");
}

}  // namespace
}  // namespace moecore::model
