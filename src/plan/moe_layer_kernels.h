// The kernels of one MoE layer's forward and backward as moecore runs them on CUDA under --bf16
// today, each with its FLOPs and HBM bytes, and the roofline time that follows at given device
// peaks: the predictions the GPU check's MoE-layer benchmark is read against (bench_moe_layer
// --predict, bench/RESULTS.md "The MoE layer on an H100").
//
// The dataflow counted (src/moe/, src/nn/mlp.cpp on the native bf16 path, no biases; docs/design.md
// "The MoE token path under --bf16"): the layer's input and output f32; the tokens cast to bf16
// once and moved as bf16 rows (local dispatch, EP 1: gathers); the routed experts' grouped GEMMs
// from device tables (no host read of the group sizes: `syncs` 0; three launches each: the
// table kernel, the backend's, the GEMM), fc1 writing h as bf16 in the GEMM, the activation
// reading the bf16 h and writing the bf16 fc2 input, fc2 and the dgrads writing f32 rows that are
// rounded once to bf16 for the way back, the expert input rows kept as bf16 for fc1's weight
// gradient, the weight gradients accumulated into the f32 gradients (read and written). The
// shared expert's GEMMs are one strided-batched matmul each. The router runs its GEMMs in f32
// (CUDA cores, TF32 off) and its selection and losses on [T, E] in f64: small kernels whose time
// is their launches, not their bytes.
// Legend: T tokens, H hidden, F expert ffn, F1 = 2F (SwiGLU's [gate; up]), E experts, K top-k,
// N = T K routed rows, Fs the shared expert's ffn.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore::plan {

// One MoE layer of the benchmark: Megatron's MoE perf-test shapes by name
// (tests/functional_tests/test_cases/common/moe_perf/test_cases.py: MIXTRAL_PROXY,
// DEEPSEEK_PROXY, 4096 tokens), or small ones for the CPU.
struct MoeBenchShape {
  std::string name = "custom";
  int64_t tokens = 4096;      // T (one sequence of T tokens: seq_aux_loss's sequence)
  int64_t hidden = 4096;      // H
  int64_t ffn = 14336;        // F per expert
  int64_t experts = 8;        // E
  int64_t topk = 2;           // K
  int64_t shared_ffn = 0;     // Fs (0: no shared expert)
  bool sigmoid = false;       // sigmoid scores with the expert bias (DeepSeek), else softmax
  int64_t groups = 0;         // --moe-router-num-groups (0: no group limit)
  int64_t group_topk = 0;     // --moe-router-group-topk
  bool seq_aux_loss = false;  // seq_aux_loss, else aux_loss (coefficient 1.0 either way)

  int64_t rows() const { return tokens * topk; }  // N
};

// mixtral (H 4096, F 14336, E 8, K 2, softmax, aux_loss), deepseek (H 7168, F 2048, E 32, K 8,
// sigmoid + expert bias, 8 groups keep 4, seq_aux_loss, shared expert 2048), both at 4096
// tokens; small and small-deepseek: the same routing at CPU sizes (the ctest). Throws listing
// the names for another.
MoeBenchShape moe_bench_preset(const std::string& name);
std::vector<std::string> moe_bench_preset_names();

struct KernelCost {
  std::string name;       // what runs, e.g. "experts fc1 grouped GEMM"
  std::string pass;       // "fwd" or "bwd"
  std::string group;      // router, permute, experts, shared
  double flops = 0;       // bf16 tensor-core FLOPs (f32 CUDA-core FLOPs when f32_gemm)
  double bytes = 0;       // HBM bytes read + written, nothing served from L2
  bool f32_gemm = false;  // the router's GEMMs: f32 on CUDA cores
  int launches = 1;       // kernel launches (the latency floor of small kernels)
  int syncs = 0;          // host reads of grouped-GEMM sizes (a wait for the stream each)
  double latency_us = 0;  // an estimated floor beyond launches x launch_us (the permutation maps)
};

// Every kernel (or small group of kernels) of one forward + backward, in the order they run.
std::vector<KernelCost> moe_layer_kernels(const MoeBenchShape& s);

// The peaks a prediction is made at. Defaults: the H100 measured on the GPU machine
// (/work/shared/CUDA_BACKEND.md: bf16 GEMM ~798 TFLOP/s, device copy ~3.0 TB/s) and the
// planner's H100 SXM fp32 peak (src/plan/hardware.cpp, 67 TFLOP/s); launch_us and sync_us are
// estimates (a small kernel back to back on a stream; a host read of the sizes and the idle
// stream until the next launch), not roofline quantities.
struct DevicePeaks {
  double bf16_tflops = 798;
  double fp32_tflops = 67;
  double hbm_tbps = 3.0;
  double launch_us = 3.0;
  double sync_us = 15.0;
};

// max(FLOPs / peak, bytes / HBM bandwidth, launches x launch_us, latency_us) + syncs x sync_us.
double predicted_seconds(const KernelCost& k, const DevicePeaks& p);
// "flops", "bytes" or "latency": what decides the kernel's predicted time.
const char* bound_by(const KernelCost& k, const DevicePeaks& p);

// The layer's model FLOPs of one forward + backward, Megatron's 3 x forward: router 2 T H E,
// routed experts 2 N H (F1 + F), shared expert 2 T H (2 Fs + Fs); what TFLOP/s and MFU divide.
double moe_layer_model_flops(const MoeBenchShape& s);

}  // namespace moecore::plan
