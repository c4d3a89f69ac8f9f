// The MoE layer's kernel roofline (plan/moe_layer_kernels.h): the FLOPs and bytes of the kernels
// that decide the predictions of bench/RESULTS.md, against hand arithmetic at the perf-test shapes.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "plan/moe_layer_kernels.h"

namespace moecore::plan {
namespace {

const KernelCost& find(const std::vector<KernelCost>& ks, const std::string& pass,
                       const std::string& name) {
  for (const KernelCost& k : ks) {
    if (k.pass == pass && k.name == name) return k;
  }
  ADD_FAILURE() << "no kernel " << pass << " " << name;
  static const KernelCost none;
  return none;
}

TEST(MoeLayerKernels, PresetsAreMegatronsPerfTestShapes) {
  const MoeBenchShape m = moe_bench_preset("mixtral");
  EXPECT_EQ(m.tokens, 4096);
  EXPECT_EQ(m.hidden, 4096);
  EXPECT_EQ(m.ffn, 14336);
  EXPECT_EQ(m.experts, 8);
  EXPECT_EQ(m.topk, 2);
  EXPECT_EQ(m.shared_ffn, 0);
  EXPECT_FALSE(m.sigmoid);
  const MoeBenchShape d = moe_bench_preset("deepseek");
  EXPECT_EQ(d.hidden, 7168);
  EXPECT_EQ(d.ffn, 2048);
  EXPECT_EQ(d.experts, 32);
  EXPECT_EQ(d.topk, 8);
  EXPECT_EQ(d.shared_ffn, 2048);
  EXPECT_TRUE(d.sigmoid);
  EXPECT_EQ(d.groups, 8);
  EXPECT_EQ(d.group_topk, 4);
  EXPECT_TRUE(d.seq_aux_loss);
  EXPECT_THROW(moe_bench_preset("qwen"), std::exception);
}

TEST(MoeLayerKernels, MixtralExpertGemmsByHand) {
  const auto ks = moe_layer_kernels(moe_bench_preset("mixtral"));
  // N = 4096 x 2 rows; fc1 [E, 2F, H]: 2 N H 2F FLOPs; bf16 x rows, bf16 weights, bf16 h
  // written by the GEMM, from device tables (three launches, no host read of the sizes).
  const double N = 8192, H = 4096, F = 14336, E = 8;
  const KernelCost& fc1 = find(ks, "fwd", "experts: fc1 grouped GEMM");
  EXPECT_DOUBLE_EQ(fc1.flops, 2 * N * H * 2 * F);
  EXPECT_DOUBLE_EQ(fc1.bytes, 2 * N * H + 2 * E * 2 * F * H + 2 * N * 2 * F);
  EXPECT_EQ(fc1.syncs, 0);
  EXPECT_EQ(fc1.launches, 3);
  // The activation reads the bf16 h and writes the bf16 fc2 input (and reads the probs).
  EXPECT_DOUBLE_EQ(find(ks, "fwd", "experts: SwiGLU x prob to bf16").bytes,
                   2 * N * 2 * F + 4 * N + 2 * N * F);
  // The fc1 weight gradient reads and writes the f32 gradient [E, 2F, H]: 7.5 GB.
  const KernelCost& wg = find(ks, "bwd", "experts: fc1 wgrad (f32 accumulate)");
  EXPECT_DOUBLE_EQ(wg.bytes, 2 * N * 2 * F + 2 * N * H + 8 * E * 2 * F * H);
  const DevicePeaks p;  // 798 TFLOP/s, 3.0 TB/s
  EXPECT_STREQ(bound_by(fc1, p), "flops");
  EXPECT_NEAR(predicted_seconds(fc1, p), 2 * N * H * 2 * F / 798e12, 1e-12);
  EXPECT_STREQ(bound_by(wg, p), "bytes");  // 2.68 ms of bytes against 2.41 ms of FLOPs
  EXPECT_NEAR(predicted_seconds(wg, p), wg.bytes / 3.0e12, 1e-12);
  // Model FLOPs: 3 x (router 2 T H E + experts 2 N H 3F).
  EXPECT_DOUBLE_EQ(moe_layer_model_flops(moe_bench_preset("mixtral")),
                   3 * (2 * 4096 * H * E + 2 * N * H * 3 * F));
}

TEST(MoeLayerKernels, DeepSeekHasTheSharedExpertAndTheSameRoutedWork) {
  const MoeBenchShape d = moe_bench_preset("deepseek");
  const auto ks = moe_layer_kernels(d);
  const double T = 4096, H = 7168, N = T * 8, F = 2048, Fs = 2048;
  EXPECT_DOUBLE_EQ(find(ks, "fwd", "experts: fc2 grouped GEMM").flops, 2 * N * F * H);
  EXPECT_DOUBLE_EQ(find(ks, "fwd", "shared: fc1 GEMM").flops, 2 * T * H * 2 * Fs);
  EXPECT_DOUBLE_EQ(find(ks, "bwd", "shared: fc2 wgrad (f32 accumulate)").flops, 2 * T * H * Fs);
  // The routed experts' FLOPs equal Mixtral's (N H F: 32768 x 7168 x 2048 = 8192 x 4096 x 14336).
  EXPECT_DOUBLE_EQ(
      find(ks, "fwd", "experts: fc1 grouped GEMM").flops,
      find(moe_layer_kernels(moe_bench_preset("mixtral")), "fwd", "experts: fc1 grouped GEMM")
          .flops);
  // The small routing kernels: one more launch each for the group mask and the expert bias.
  EXPECT_EQ(find(ks, "fwd", "router scores, top-k, probs, losses").launches, 15);
  EXPECT_STREQ(bound_by(find(ks, "fwd", "permutation maps (build_permutation)"), DevicePeaks{}),
               "latency");
  // Every (pass, name) once: the bench maps its measured kernels to these names.
  std::set<std::string> seen;
  for (const KernelCost& k : ks) EXPECT_TRUE(seen.insert(k.pass + " " + k.name).second) << k.name;
  double flops = 0;
  for (const KernelCost& k : ks) flops += k.flops;
  EXPECT_NEAR(flops, moe_layer_model_flops(d), 1e-9 * flops);  // every model FLOP is a kernel's
}

}  // namespace
}  // namespace moecore::plan
