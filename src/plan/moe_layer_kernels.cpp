#include "plan/moe_layer_kernels.h"

#include <algorithm>

#include "core/check.h"

namespace moecore::plan {

namespace {

MoeBenchShape mixtral() {
  MoeBenchShape s;
  s.name = "mixtral";
  return s;  // the defaults: T 4096, H 4096, F 14336, E 8, K 2, softmax, aux_loss
}

MoeBenchShape deepseek() {
  MoeBenchShape s;
  s.name = "deepseek";
  s.hidden = 7168;
  s.ffn = 2048;
  s.experts = 32;
  s.topk = 8;
  s.shared_ffn = 2048;
  s.sigmoid = true;
  s.groups = 8;
  s.group_topk = 4;
  s.seq_aux_loss = true;
  return s;
}

}  // namespace

std::vector<std::string> moe_bench_preset_names() {
  return {"mixtral", "deepseek", "small", "small-deepseek"};
}

MoeBenchShape moe_bench_preset(const std::string& name) {
  if (name == "mixtral") return mixtral();
  if (name == "deepseek") return deepseek();
  if (name == "small") {
    MoeBenchShape s = mixtral();
    s.name = name;
    s.tokens = 256;
    s.hidden = 128;
    s.ffn = 256;
    return s;
  }
  if (name == "small-deepseek") {
    MoeBenchShape s = deepseek();
    s.name = name;
    s.tokens = 256;
    s.hidden = 128;
    s.ffn = 64;
    s.shared_ffn = 64;
    return s;
  }
  MOE_FAIL("[moe-bench] unknown preset '{}': choose mixtral, deepseek, small or small-deepseek",
           name);
}

std::vector<KernelCost> moe_layer_kernels(const MoeBenchShape& s) {
  const double T = static_cast<double>(s.tokens), H = static_cast<double>(s.hidden);
  const double F = static_cast<double>(s.ffn), F1 = 2 * F, E = static_cast<double>(s.experts);
  const double K = static_cast<double>(s.topk), N = T * K, Fs = static_cast<double>(s.shared_ffn);
  std::vector<KernelCost> k;
  auto add = [&](std::string name, const char* pass, const char* group, double flops, double bytes,
                 int launches = 1, int syncs = 0) {
    KernelCost c;
    c.name = std::move(name);
    c.pass = pass;
    c.group = group;
    c.flops = flops;
    c.bytes = bytes;
    c.launches = launches;
    c.syncs = syncs;
    k.push_back(c);
    return &k.back();
  };
  // The router's [T, E] kernels: widen the logits to f64, scores, routing key, (group mask),
  // top-k, gather, probs, capacity, narrow, counts x 2, the report, the aux and z losses,
  // (the expert bias's counts); each pass reads or writes about one [T, E] f64 array.
  const int fwd_small = 13 + (s.groups > 0 ? 1 : 0) + (s.sigmoid ? 1 : 0);
  const int bwd_small = 9;
  const double te_pass = T * E * 8;

  // Forward.
  add("router GEMM (f32)", "fwd", "router", 2 * T * H * E, 4 * (T * H + E * H + T * E))->f32_gemm =
      true;
  add("router scores, top-k, probs, losses", "fwd", "router", 0, fwd_small * te_pass, fwd_small);
  {
    // build_permutation: tiles of S slots (S = max(512, 2E)), S / 32 rounds of a warp each in
    // the count and the place launches (~1.5 us a round), the [E, tiles] scan, two small ones.
    KernelCost* c =
        add("permutation maps (build_permutation)", "fwd", "permute", 0, T * K * 4 + 3 * N * 4, 6);
    const double S = std::max(512.0, 2 * E), tiles = std::max(1.0, N / S);
    c->latency_us = 2 * (S / 32) * 1.5 + std::max(1.0, E * tiles / 1024) * 3 + 6;
  }
  // --bf16 on a GPU (the native path, no biases: Megatron's MoE recipes), as the layer runs it
  // (docs/design.md, "The MoE token path under --bf16"): the tokens cast to bf16 once and moved
  // as bf16 rows; the routed experts' grouped GEMMs from device tables (the table kernel, the
  // backend's table kernel and the GEMM: 3 launches, no host read); fc1 writes h as bf16 in the
  // GEMM (GemmTypes::Bf16Bf16); the activation reads the bf16 h and writes the bf16 fc2 input;
  // fc2 and the dgrads write f32 rows, rounded once to bf16 for the way back; the expert input
  // rows are kept as bf16 for fc1's weight gradient; the weight gradients accumulate into f32.
  const int gemm_launches = 3;
  add("dispatch: cast x to bf16", "fwd", "permute", 0, 6 * T * H);
  add("dispatch: permute bf16 rows + probs", "fwd", "permute", 0, 4 * N * H + 12 * N, 2);
  add("experts: fc1 grouped GEMM", "fwd", "experts", 2 * N * H * F1,
      2 * N * H + 2 * E * F1 * H + 2 * N * F1, gemm_launches);
  add("experts: SwiGLU x prob to bf16", "fwd", "experts", 0, 2 * N * F1 + 4 * N + 2 * N * F);
  add("experts: fc2 grouped GEMM", "fwd", "experts", 2 * N * F * H,
      2 * N * F + 2 * E * H * F + 4 * N * H, gemm_launches);
  add("combine: round rows to bf16", "fwd", "permute", 0, 6 * N * H);
  add("combine: unpermute rows (sum of K)", "fwd", "permute", 0, 2 * N * H + 4 * T * H + 4 * N);
  if (Fs > 0) {
    // The shared expert: nn::MLP, its GEMMs one strided-batched matmul each (one group whose rows
    // the host knows), fc1 writing the bf16 h too.
    add("shared: cast x to bf16", "fwd", "shared", 0, 6 * T * H);
    add("shared: fc1 GEMM", "fwd", "shared", 2 * T * H * 2 * Fs,
        2 * T * H + 2 * 2 * Fs * H + 2 * T * 2 * Fs);
    add("shared: SwiGLU to bf16", "fwd", "shared", 0, 2 * T * 2 * Fs + 2 * T * Fs);
    add("shared: fc2 GEMM", "fwd", "shared", 2 * T * Fs * H, 2 * T * Fs + 2 * H * Fs + 4 * T * H);
    add("shared: add output", "fwd", "shared", 0, 12 * T * H);
  }

  // Backward.
  add("combine bwd: cast dy to bf16", "bwd", "permute", 0, 6 * T * H);
  add("combine bwd: permute dy rows", "bwd", "permute", 0, 4 * N * H + 4 * N);
  add("experts: fc2 dgrad", "bwd", "experts", 2 * N * H * F, 2 * N * H + 2 * E * H * F + 4 * N * F,
      gemm_launches);
  add("experts: fc2 wgrad (f32 accumulate)", "bwd", "experts", 2 * N * H * F,
      2 * N * H + 2 * N * F + 8 * E * H * F, gemm_launches);
  add("experts: SwiGLU backward to bf16", "bwd", "experts", 0,
      4 * N * F + 2 * N * F1 + 4 * N + 2 * N * F1 + 4 * N);
  add("experts: fc1 dgrad", "bwd", "experts", 2 * N * F1 * H,
      2 * N * F1 + 2 * E * F1 * H + 4 * N * H, gemm_launches);
  add("experts: fc1 wgrad (f32 accumulate)", "bwd", "experts", 2 * N * F1 * H,
      2 * N * F1 + 2 * N * H + 8 * E * F1 * H, gemm_launches);
  add("dispatch bwd: round dx rows to bf16", "bwd", "permute", 0, 6 * N * H);
  add("dispatch bwd: unpermute dx rows + dprobs", "bwd", "permute", 0,
      2 * N * H + 4 * T * H + 8 * N, 2);
  add("router bwd: probs, aux and z-loss gradients", "bwd", "router", 0, bwd_small * te_pass,
      bwd_small);
  add("router GEMMs bwd (f32: dx, dw)", "bwd", "router", 4 * T * E * H,
      4 * (2 * T * E + 2 * E * H + 3 * T * H), 2)
      ->f32_gemm = true;
  if (Fs > 0) {
    add("shared: cast dy to bf16", "bwd", "shared", 0, 6 * T * H);
    add("shared: fc2 dgrad", "bwd", "shared", 2 * T * H * Fs, 2 * T * H + 2 * H * Fs + 4 * T * Fs);
    add("shared: fc2 wgrad (f32 accumulate)", "bwd", "shared", 2 * T * H * Fs,
        2 * T * H + 2 * T * Fs + 8 * H * Fs);
    add("shared: SwiGLU backward to bf16", "bwd", "shared", 0,
        4 * T * Fs + 2 * T * 2 * Fs + 2 * T * 2 * Fs);
    add("shared: cast x to bf16 again", "bwd", "shared", 0, 6 * T * H);
    add("shared: fc1 dgrad", "bwd", "shared", 2 * T * 2 * Fs * H,
        2 * T * 2 * Fs + 2 * 2 * Fs * H + 4 * T * H);
    add("shared: fc1 wgrad (f32 accumulate)", "bwd", "shared", 2 * T * 2 * Fs * H,
        2 * T * 2 * Fs + 2 * T * H + 8 * 2 * Fs * H);
    add("shared: add input gradient", "bwd", "shared", 0, 12 * T * H);
  }
  return k;
}

namespace {

struct Terms {
  double compute, memory, latency, sync;
};

Terms terms(const KernelCost& k, const DevicePeaks& p) {
  const double peak = (k.f32_gemm ? p.fp32_tflops : p.bf16_tflops) * 1e12;
  return Terms{k.flops / peak, k.bytes / (p.hbm_tbps * 1e12),
               std::max(k.launches * p.launch_us, k.latency_us) * 1e-6, k.syncs * p.sync_us * 1e-6};
}

}  // namespace

double predicted_seconds(const KernelCost& k, const DevicePeaks& p) {
  const Terms t = terms(k, p);
  return std::max({t.compute, t.memory, t.latency}) + t.sync;
}

const char* bound_by(const KernelCost& k, const DevicePeaks& p) {
  const Terms t = terms(k, p);
  if (t.compute >= t.memory && t.compute >= t.latency) return "flops";
  return t.memory >= t.latency ? "bytes" : "latency";
}

double moe_layer_model_flops(const MoeBenchShape& s) {
  const double T = static_cast<double>(s.tokens), H = static_cast<double>(s.hidden);
  const double F = static_cast<double>(s.ffn), N = static_cast<double>(s.rows());
  const double Fs = static_cast<double>(s.shared_ffn);
  const double fwd =
      2 * T * H * static_cast<double>(s.experts) + 2 * N * H * 3 * F + 2 * T * H * 3 * Fs;
  return 3 * fwd;
}

}  // namespace moecore::plan
