// Multi-latent attention, one rank: the f64 layer against a plain-loop transcription of
// Megatron's MLASelfAttention (q / kv down and up projections, RMSNorms, interleaved rotary on the
// rotated parts only with k's shared by the heads, softmax scale mscale^2 / sqrt(qk + pe), causal
// softmax, linear_proj), with and without q LoRA and the norms, v narrower and wider than q / k;
// f64 finite differences of every parameter and the input (YaRN on); f32 vs f64; --bf16 in
// both weight forms vs f32; the names.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "common/layer_testing.h"
#include "common/testing.h"
#include "core/arena.h"
#include "model/mla_attention.h"
#include "ops/gemm_bf16.h"

namespace moecore::model {
namespace {

using testing::host;
using testing::random_vec;

struct Case {
  const char* name;
  int64_t q_lora, qk, pe, dv;
  bool norms;
  ops::RopeType rope;
  bool bias = false;  // linear_proj.bias (--add-attention-output-bias)
};

// v narrower than q / k (heads padded for v, the per-head output projection), wider (q and k
// padded), equal; YaRN with a ramp inside the 2 pairs and mscale != mscale_all_dim.
const Case kCases[] = {
    {"q LoRA, norms, yarn, dv < qk + pe, bias", 6, 3, 4, 5, true, ops::RopeType::Yarn, true},
    {"no q LoRA, norms, yarn, dv > qk + pe", 0, 3, 4, 9, true, ops::RopeType::Yarn},
    {"q LoRA, no norms, rope, dv = qk + pe", 5, 2, 4, 6, false, ops::RopeType::Rope},
};

ModelConfig config(const Case& c) {
  ModelConfig cfg;
  cfg.hidden = 8;
  cfg.num_heads = 2;
  cfg.seq_length = 5;
  cfg.init_std = 0.4;
  cfg.num_layers = 2;
  cfg.normalization = Normalization::RMSNorm;
  cfg.qk_layernorm = c.norms;
  cfg.add_attention_output_bias = c.bias;
  cfg.multi_latent_attention = true;
  cfg.mla.q_lora_rank = c.q_lora;
  cfg.mla.kv_lora_rank = 5;
  cfg.mla.qk_head_dim = c.qk;
  cfg.mla.qk_pos_emb_head_dim = c.pe;
  cfg.mla.v_head_dim = c.dv;
  cfg.mla.rope_type = c.rope;
  cfg.mla.yarn = ops::YarnParams{4.0, 2, 32.0, 1.0, 1.0, 0.8};
  return cfg;
}

std::vector<double> weights(ParamRegistry& params, const std::string& name) {
  Param& p = params.get(name);
  const double* d = host(p.data_as<double>());
  return std::vector<double>(d, d + p.local_numel());
}

// y[M, N] = x[M, K] w[N, K]^T
std::vector<double> linear(const std::vector<double>& x, const std::vector<double>& w, int64_t M,
                           int64_t N, int64_t K) {
  std::vector<double> y(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t k = 0; k < K; ++k) y[m * N + j] += x[m * K + k] * w[j * K + k];
  return y;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<double>& w, int64_t M,
                            int64_t D, double eps) {
  std::vector<double> y(M * D);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[m * D + j] * x[m * D + j];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t j = 0; j < D; ++j) y[m * D + j] = x[m * D + j] * r * w[j];
  }
  return y;
}

// Megatron's MLASelfAttention forward, written out from its definition.
std::vector<double> reference(const ModelConfig& cfg, ParamRegistry& params,
                              const std::string& prefix, const std::vector<double>& x, int64_t S,
                              int64_t B) {
  const MlaConfig& m = cfg.mla;
  const int64_t n = S * B, H = cfg.hidden, Hq = cfg.num_heads, qk = m.qk_head_dim,
                pe = m.qk_pos_emb_head_dim, dv = m.v_head_dim, dq = qk + pe,
                kl = m.kv_lora_rank;
  auto w = [&](const std::string& name) { return weights(params, prefix + "." + name); };
  std::vector<double> Q;
  if (m.q_lora_rank > 0) {
    std::vector<double> c = linear(x, w("linear_q_down_proj.weight"), n, m.q_lora_rank, H);
    if (cfg.qk_layernorm) c = rmsnorm(c, w("q_layernorm.weight"), n, m.q_lora_rank, cfg.norm_eps);
    Q = linear(c, w("linear_q_up_proj.weight"), n, Hq * dq, m.q_lora_rank);
  } else {
    Q = linear(x, w("linear_q_proj.weight"), n, Hq * dq, H);
  }
  const std::vector<double> kvd = linear(x, w("linear_kv_down_proj.weight"), n, kl + pe, H);
  std::vector<double> lat(n * kl), kpe(n * pe);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < kl; ++j) lat[t * kl + j] = kvd[t * (kl + pe) + j];
    for (int64_t i = 0; i < pe; ++i) kpe[t * pe + i] = kvd[t * (kl + pe) + kl + i];
  }
  if (cfg.qk_layernorm) lat = rmsnorm(lat, w("kv_layernorm.weight"), n, kl, cfg.norm_eps);
  const std::vector<double> KV = linear(lat, w("linear_kv_up_proj.weight"), n, Hq * (qk + dv), kl);
  std::vector<int32_t> pos(n);
  for (int64_t t = 0; t < n; ++t) pos[t] = int32_t(t / B);
  const ops::RopeMlaSpec spec = m.rope_spec(cfg.rotary_base);
  std::vector<double> qpe(n * Hq * pe), kpe_r(n * pe);
  ops::rope_mla_forward_ref(qpe.data(), Q.data() + qk, pos.data(), n, Hq, pe, dq, spec);
  ops::rope_mla_forward_ref(kpe_r.data(), kpe.data(), pos.data(), n, 1, pe, pe, spec);
  const double ms = ops::yarn_get_mscale(m.yarn.scaling_factor, m.yarn.mscale_all_dim);
  const double scale = ms * ms / std::sqrt(double(dq));
  std::vector<double> o(n * Hq * dv, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = t / B, b = t % B;
    for (int64_t h = 0; h < Hq; ++h) {
      std::vector<double> sc(s + 1);
      double mx = -INFINITY;
      for (int64_t s2 = 0; s2 <= s; ++s2) {
        const int64_t u = s2 * B + b;
        double dot = 0;
        for (int64_t j = 0; j < qk; ++j)
          dot += Q[(t * Hq + h) * dq + j] * KV[(u * Hq + h) * (qk + dv) + j];
        for (int64_t i = 0; i < pe; ++i) dot += qpe[(t * Hq + h) * pe + i] * kpe_r[u * pe + i];
        sc[s2] = scale * dot;
        mx = std::max(mx, sc[s2]);
      }
      double z = 0;
      for (double& e : sc) z += (e = std::exp(e - mx));
      for (int64_t s2 = 0; s2 <= s; ++s2) {
        const int64_t u = s2 * B + b;
        for (int64_t j = 0; j < dv; ++j)
          o[(t * Hq + h) * dv + j] += sc[s2] / z * KV[(u * Hq + h) * (qk + dv) + qk + j];
      }
    }
  }
  std::vector<double> y = linear(o, w("linear_proj.weight"), n, H, Hq * dv);
  if (cfg.add_attention_output_bias) {
    const std::vector<double> b = w("linear_proj.bias");
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < H; ++j) y[t * H + j] += b[j];
  }
  return y;
}

constexpr int64_t S = 5, B = 2, n = S * B;

TEST(MlaAttention, MatchesMegatronsDefinition) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const ModelConfig cfg = config(c);
    ParamRegistry params{DType::F64};
    const ops::RopeMlaTables rope(S, cfg.mla.rope_spec(cfg.rotary_base));
    MlaAttention<double> attn(cfg, params, "attn", rope);
    Arena arena;
    testing::plan_layer(arena, params, 7, [&](Arena& a) { attn.allocate(a, S, B); });
    if (params.find("attn.linear_proj.bias") != nullptr) {  // zero at init
      Param& bias = params.get("attn.linear_proj.bias");
      for (int64_t i = 0; i < bias.local_numel(); ++i)
        host(bias.data_as<double>())[i] = 0.3 * std::sin(double(i + 1));
    }
    const std::vector<double> x = random_vec<double>(n * cfg.hidden, 11);
    std::vector<double> y(n * cfg.hidden);
    attn.forward(y.data(), x.data());
    const std::vector<double> want = reference(cfg, params, "attn", x, S, B);
    EXPECT_TRUE(testing::all_close(y, want, 1e-12, 1e-12));
  }
}

TEST(MlaAttention, FiniteDifferencesOfEveryParameterAndTheInput) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const ModelConfig cfg = config(c);
    ParamRegistry params{DType::F64};
    const ops::RopeMlaTables rope(S, cfg.mla.rope_spec(cfg.rotary_base));
    MlaAttention<double> attn(cfg, params, "attn", rope);
    Arena arena;
    testing::plan_layer(arena, params, 3, [&](Arena& a) { attn.allocate(a, S, B); });
    // Norm weights away from 1, so their gradients are not the only thing that moves them.
    for (Param& p : params.params()) {
      if (p.name().find("layernorm") == std::string::npos) continue;
      double* d = host(p.data_as<double>());
      for (int64_t i = 0; i < p.local_numel(); ++i) d[i] = 1.0 + 0.3 * std::sin(double(i + 1));
    }
    std::vector<double> x = random_vec<double>(n * cfg.hidden, 2);
    const std::vector<double> R = random_vec<double>(n * cfg.hidden, 4);
    std::vector<double> y(n * cfg.hidden), dx(n * cfg.hidden);
    auto loss = [&] {
      attn.forward(y.data(), x.data());
      return testing::weighted_sum(y.data(), R);
    };
    EXPECT_TRUE(testing::check_layer_gradients(
        params, loss, [&] { attn.backward(dx.data(), R.data()); },
        {{x.data(), dx.data(), n * cfg.hidden, "dx"}}));
  }
}

// The same weights in f32 and f64: outputs, the input gradient and every parameter gradient
// within f32's tolerance.
TEST(MlaAttention, F32AgreesWithF64) {
  const Case& c = kCases[0];
  const ModelConfig cfg = config(c);
  ParamRegistry p64{DType::F64}, p32{DType::F32};
  const ops::RopeMlaTables rope(S, cfg.mla.rope_spec(cfg.rotary_base));
  MlaAttention<double> a64(cfg, p64, "attn", rope);
  MlaAttention<float> a32(cfg, p32, "attn", rope);
  Arena r64, r32;
  testing::plan_layer(r64, p64, 5, [&](Arena& a) { a64.allocate(a, S, B); });
  testing::plan_layer(r32, p32, 5, [&](Arena& a) { a32.allocate(a, S, B); });
  const int64_t N = n * cfg.hidden;
  const std::vector<double> x = random_vec<double>(N, 8), R = random_vec<double>(N, 9);
  const std::vector<float> xf(x.begin(), x.end()), Rf(R.begin(), R.end());
  std::vector<double> y(N), dx(N);
  std::vector<float> yf(N), dxf(N);
  a64.forward(y.data(), x.data());
  a32.forward(yf.data(), xf.data());
  a64.backward(dx.data(), R.data());
  a32.backward(dxf.data(), Rf.data());
  const double rtol = moecore::testing::kF32Rtol, atol = moecore::testing::kF32Atol;
  EXPECT_TRUE(testing::all_close(yf.data(), y.data(), N, rtol, atol)) << "y";
  EXPECT_TRUE(testing::all_close(dxf.data(), dx.data(), N, rtol, atol)) << "dx";
  for (Param& p : p64.params()) {
    Param& q = p32.get(p.name());
    EXPECT_TRUE(testing::all_close(host(q.grad_as<float>()), host(p.grad_as<double>()), p.local_numel(),
                                   rtol, atol))
        << p.name();
  }
}

// --bf16 in the layer, f32 weights with bf16 copies in both forms the registry keeps: bf16
// (what the native GEMMs read; here through the CPU's bf16 GEMM path, which widens them) and
// widened to f32 (the widened path's f32 GEMMs over rounded inputs). Both forms compute the same
// products of the same bf16 values in f32 (the "bf16 GEMM vs loop" row of docs/numerics.md),
// and both track the f32 layer within the --bf16 rows: the output, the input gradient and every
// parameter gradient, norm of the difference over the norm. The cases cover the kv down
// projection's two row blocks, linear_proj over padded heads (column blocks), the input gradient
// added over the q and kv paths, and linear_q_proj.
TEST(MlaAttention, Bf16WeightFormsAgreeAndTrackF32) {
  auto rel_norm = [](const float* a, const float* b, int64_t n) {
    double d = 0, r = 0;
    for (int64_t i = 0; i < n; ++i) {
      d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      r += double(b[i]) * b[i];
    }
    return std::sqrt(d / r);
  };
  for (const Case& c : {kCases[0], kCases[1]}) {
    SCOPED_TRACE(c.name);
    const ModelConfig cfg = config(c);
    const ops::RopeMlaTables rope(S, cfg.mla.rope_spec(cfg.rotary_base));
    const int64_t N = n * cfg.hidden;
    const std::vector<double> x = random_vec<double>(N, 8), R = random_vec<double>(N, 9);
    const std::vector<float> xf(x.begin(), x.end()), Rf(R.begin(), R.end());
    struct Out {
      std::vector<float> y, dx;
    };
    // form 0: f32, 1: bf16, 2: widened. The arena holds the gradients read below.
    auto run = [&](ParamRegistry& params, Arena& arena, int form) {
      // The widened copies are the widen path's: run them on it (the native path reads bf16
      // copies, which a widened registry does not keep).
      const ops::Bf16GemmPath chosen = ops::bf16_gemm_path();
      if (form == 2) ops::set_bf16_gemm_path(ops::Bf16GemmPath::Widen);
      if (form > 0) params.enable_bf16_copies(/*widened=*/form == 2);
      MlaAttention<float> attn(cfg, params, "attn", rope);
      testing::plan_layer(arena, params, 5, [&](Arena& a) { attn.allocate(a, S, B); });
      if (form > 0) params.refresh_bf16();
      Out o{std::vector<float>(N), std::vector<float>(N)};
      attn.forward(o.y.data(), xf.data());
      attn.backward(o.dx.data(), Rf.data());
      ops::set_bf16_gemm_path(chosen);
      return o;
    };
    ParamRegistry p32{DType::F32}, p16{DType::F32}, p16w{DType::F32};
    Arena a32, a16, a16w;
    const Out o32 = run(p32, a32, 0), o16 = run(p16, a16, 1), o16w = run(p16w, a16w, 2);
    ASSERT_NE(p16.get("attn.linear_proj.weight").data16, nullptr);
    ASSERT_NE(p16w.get("attn.linear_proj.weight").data16w, nullptr);
    const double rtol = moecore::testing::kF32Rtol, atol = moecore::testing::kF32Atol;
    EXPECT_TRUE(testing::all_close(o16.y.data(), o16w.y.data(), N, rtol, atol)) << "y";
    EXPECT_TRUE(testing::all_close(o16.dx.data(), o16w.dx.data(), N, rtol, atol)) << "dx";
    const double bf16 = moecore::testing::kBf16GradRelNorm;
    for (const Out* o : {&o16, &o16w}) {
      EXPECT_LE(rel_norm(o->y.data(), o32.y.data(), N), bf16) << "y";
      EXPECT_LE(rel_norm(o->dx.data(), o32.dx.data(), N), bf16) << "dx";
      EXPECT_GT(rel_norm(o->y.data(), o32.y.data(), N), 0) << "y: no bf16 rounding happened";
    }
    for (Param& p : p32.params()) {
      const float* g32 = host(p.grad_as<float>());
      const float* g16 = host(p16.get(p.name()).grad_as<float>());
      const float* g16w = host(p16w.get(p.name()).grad_as<float>());
      EXPECT_TRUE(testing::all_close(g16, g16w, p.local_numel(), rtol, atol)) << p.name();
      EXPECT_LE(rel_norm(g16, g32, p.local_numel()), bf16) << p.name();
      EXPECT_LE(rel_norm(g16w, g32, p.local_numel()), bf16) << p.name();
    }
  }
}

TEST(MlaAttention, MegatronParameterNames) {
  std::set<std::string> with_lora, without;
  for (const bool lora : {true, false}) {
    ModelConfig cfg = config(kCases[0]);  // with linear_proj.bias
    if (!lora) {
      cfg.mla.q_lora_rank = 0;
      cfg.add_attention_output_bias = false;
      cfg.add_qkv_bias = true;  // the QKV attention's: MLA has none (Megatron's)
    }
    ParamRegistry params{DType::F64};
    const ops::RopeMlaTables rope(S, cfg.mla.rope_spec(cfg.rotary_base));
    MlaAttention<double> attn(cfg, params, "decoder.layers.0.self_attention", rope);
    for (const Param& p : params.params()) (lora ? with_lora : without).insert(p.name());
  }
  const std::string p = "decoder.layers.0.self_attention.";
  EXPECT_EQ(with_lora, (std::set<std::string>{
                           p + "linear_q_down_proj.weight", p + "q_layernorm.weight",
                           p + "linear_q_up_proj.weight", p + "linear_kv_down_proj.weight",
                           p + "kv_layernorm.weight", p + "linear_kv_up_proj.weight",
                           p + "linear_proj.weight", p + "linear_proj.bias"}));
  EXPECT_EQ(without, (std::set<std::string>{p + "linear_q_proj.weight",
                                            p + "linear_kv_down_proj.weight",
                                            p + "kv_layernorm.weight",
                                            p + "linear_kv_up_proj.weight",
                                            p + "linear_proj.weight"}));
}

}  // namespace
}  // namespace moecore::model
