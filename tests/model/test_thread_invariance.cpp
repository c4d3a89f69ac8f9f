// The whole model at 1, 2 and 3 threads: docs/numerics.md says which results are the same for
// any thread count. The shapes are big enough that every parallel branch runs (the ops' omp
// regions, the grouped GEMMs' parallel-groups path with 8 balanced experts, oneDNN's threaded
// GEMMs), and the model is run in f32 and --bf16.
// The claim holds where oneDNN's sgemm is itself thread-count invariant: its AVX-512 kernels
// are (measured), its AVX2 ones are not (a few elements per GEMM differ in the last bit between
// 1 and 2 threads, e.g. M=256 N=64 K=64 'NT'), so below AVX-512 the test says so and skips.
#include <gtest/gtest.h>
#include <oneapi/dnnl/dnnl.h>

#include <random>
#include <vector>

#include "common/testing.h"
#include "model/gpt_model.h"

namespace moecore::model {

using testing::host;
namespace {

// gelu_bias: GeLU MLPs with fc1 / fc2 biases (dense, experts, shared expert).
ModelConfig threaded_config(bool bf16, bool gelu_bias = false) {
  ModelConfig cfg;
  if (gelu_bias) {
    cfg.activation = ops::Activation::GeLU;
    cfg.add_mlp_bias = true;
  }
  cfg.vocab_size = 96;
  cfg.hidden = 64;
  cfg.num_layers = 2;
  cfg.num_heads = 4;
  cfg.num_query_groups = 2;
  cfg.ffn_hidden = 128;
  cfg.seq_length = 64;
  cfg.init_std = 0.05;
  cfg.num_experts = 8;
  cfg.moe_layer_pattern = {1, 0};
  cfg.moe.router.num_experts = 8;
  cfg.moe.router.topk = 2;
  cfg.moe.router.aux_loss_coeff = 0.01;
  cfg.moe.router.z_loss_coeff = 0.001;
  cfg.moe.ffn_hidden = 96;
  cfg.moe.shared_ffn_hidden = 64;
  cfg.tie_embeddings = false;
  cfg.bf16 = bf16;
  return cfg;
}

struct StepResult {
  double loss;
  std::vector<std::vector<float>> grads;  // per parameter, registry order
};

StepResult run_at(int threads, bool bf16, bool gelu_bias = false) {
  testing::ScopedOmpThreads scoped(threads);
  const ModelConfig cfg = threaded_config(bf16, gelu_bias);
  const int64_t B = 4;
  GPTModel<float> model(cfg, B, 17);
  std::mt19937 gen(3);
  std::vector<int32_t> ids(B * cfg.seq_length), targets(B * cfg.seq_length);
  for (auto& i : ids) i = static_cast<int32_t>(gen() % cfg.vocab_size);
  for (auto& t : targets) t = static_cast<int32_t>(gen() % cfg.vocab_size);
  StepResult r;
  r.loss = model.forward(ids.data(), targets.data());
  model.params().zero_grads();
  model.backward(1.0);
  for (const Param& p : model.params().params()) {
    const float* g = host(p.grad_as<float>());
    r.grads.emplace_back(g, g + p.local_numel());
  }
  return r;
}

void expect_same(const StepResult& a, const StepResult& b, int threads, bool gelu_bias = false) {
  EXPECT_EQ(a.loss, b.loss) << "loss at " << threads << " threads";
  ASSERT_EQ(a.grads.size(), b.grads.size());
  const ModelConfig cfg = threaded_config(false, gelu_bias);
  GPTModel<float> names(cfg, 1, 1);
  for (size_t k = 0; k < a.grads.size(); ++k) {
    const std::string& name = names.params().params()[k].name();
    ASSERT_EQ(a.grads[k].size(), b.grads[k].size()) << name;
    for (size_t i = 0; i < a.grads[k].size(); ++i) {
      ASSERT_EQ(a.grads[k][i], b.grads[k][i])
          << name << " element " << i << " at " << threads << " threads vs 1";
    }
  }
}

// Whether oneDNN runs its AVX-512 kernels here (DNNL_MAX_CPU_ISA may cap it lower).
bool onednn_has_avx512() {
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  return (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
}

#define SKIP_UNLESS_ONEDNN_AVX512()                                                          \
  if (!onednn_has_avx512()) {                                                                \
    GTEST_SKIP() << "oneDNN runs below AVX-512 here; its AVX2 sgemm is not thread-count "      \
                    "invariant, so only the per-op invariance tests apply";                   \
  }

TEST(ThreadInvariance, F32LossAndGradientsBitwiseAt1To3Threads) {
  SKIP_UNLESS_ONEDNN_AVX512();
  const StepResult one = run_at(1, false);
  for (int t : {2, 3}) expect_same(one, run_at(t, false), t);
}

TEST(ThreadInvariance, Bf16LossAndGradientsBitwiseAt1To3Threads) {
  SKIP_UNLESS_ONEDNN_AVX512();
  const StepResult one = run_at(1, true);
  for (int t : {2, 3}) expect_same(one, run_at(t, true), t);
}

// The element-wise activation and the (grouped) biases, f32 and --bf16.
TEST(ThreadInvariance, GeluWithMlpBiasesBitwiseAt1To3Threads) {
  SKIP_UNLESS_ONEDNN_AVX512();
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f32");
    const StepResult one = run_at(1, bf16, true);
    for (int t : {2, 3}) expect_same(one, run_at(t, bf16, true), t, true);
  }
}

}  // namespace
}  // namespace moecore::model
