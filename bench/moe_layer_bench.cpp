// The MoE layer's forward + backward on one device: moecore's MoELayer (router, local dispatch at
// EP 1, the grouped experts, combine, the shared expert where the shape has one), timed with a
// device synchronisation around each pass, beside the bf16 (or f32) GEMM peak measured in the
// same process. The shapes are Megatron's MoE perf test's (plan/moe_layer_kernels.h: mixtral,
// deepseek; 4096 tokens) or given by flags. bench/README.md, docs/gpu.md "The GPU check".
//
//   bench_moe_layer [--device cpu|cuda] [--bf16] [--preset mixtral|deepseek|small|small-deepseek]
//       [--tokens T] [--hidden H] [--ffn F] [--experts E] [--topk K] [--shared-ffn Fs]
//       [--iters 10] [--warmup 3] [--peak-size 8192 | --peak-tflops X] [--kernels]
//       [--predict] [--predict-only] [--hbm-tbps 3.0]
//
// Prints (tools/moe_layer_torch.py prints the same [moe-layer] line for PyTorch):
//   [gemm-peak] moecore cuda bf16 8192x8192x8192: 791.3 TFLOP/s (best of 5 batches)
//   [moe-layer] moecore cuda bf16 mixtral T=4096 H=4096 F=14336 E=8 K=2 Fs=0: fwd 4.100 ms |
//       bwd 8.200 ms | fwd+bwd 12.300 ms | 704.1 TFLOP/s | 89.0% of 791.3 TFLOP/s peak (measured)
//   [moe-layer] phases of fwd+bwd (profiler, 3 iterations): router 0.310 ms, permute 0.520 ms,
//       unmarked 11.470 ms (of 12.300 ms)
// --kernels: the layer's expert and dispatch kernels once more, each alone at the layer's shapes
// (its group sizes, its permutation), ms per call beside the roofline prediction:
//   [kernel] fwd experts: fc1 grouped GEMM: 2.950 ms, predicted 2.411 ms (flops), x1.22
// --predict: the roofline prediction of every kernel of the layer (plan/moe_layer_kernels.h) at
// the H100's measured peaks (or --peak-tflops / --hbm-tbps); --predict-only prints it as the
// markdown rows of bench/RESULTS.md and exits (no device needed).
// TFLOP/s: the layer's model FLOPs (3 x forward: router, routed experts, shared expert).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "core/exec.h"
#include "core/profiler.h"
#include "moe/moe_layer.h"
#include "nn/param_registry.h"
#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/memory.h"
#include "ops/permute.h"
#include "ops/swiglu.h"
#include "plan/moe_layer_kernels.h"

#include "bench_timing.h"

using namespace moecore;

namespace {

using bench_timing::median;
using bench_timing::now;

struct Options {
  std::string device = "cpu";
  bool bf16 = false;
  plan::MoeBenchShape shape = plan::moe_bench_preset("small");
  int iters = 10, warmup = 3;
  int64_t peak_size = 0;   // 0: 8192 on cuda, 256 on the CPU
  double peak_tflops = 0;  // given: not measured
  double hbm_tbps = 0;     // 0: the prediction's default
  bool kernels = false, predict = false, predict_only = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_moe_layer: %s (see the header comment of bench/moe_layer_bench.cpp)\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  std::map<std::string, int64_t*> ints = {
      {"--tokens", &o.shape.tokens}, {"--hidden", &o.shape.hidden},
      {"--ffn", &o.shape.ffn},       {"--experts", &o.shape.experts},
      {"--topk", &o.shape.topk},     {"--shared-ffn", &o.shape.shared_ffn},
      {"--peak-size", &o.peak_size}};
  // The preset first, so that the shape flags override it wherever they stand.
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--preset") o.shape = plan::moe_bench_preset(argv[i + 1]);
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--bf16") {
      o.bf16 = true;
    } else if (a == "--kernels") {
      o.kernels = true;
    } else if (a == "--predict") {
      o.predict = true;
    } else if (a == "--predict-only") {
      o.predict = o.predict_only = true;
    } else if (a == "--preset") {
      value();
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--iters") {
      o.iters = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--warmup") {
      o.warmup = std::max(0, std::atoi(value().c_str()));
    } else if (a == "--peak-tflops") {
      o.peak_tflops = std::atof(value().c_str());
    } else if (a == "--hbm-tbps") {
      o.hbm_tbps = std::atof(value().c_str());
    } else if (ints.count(a)) {
      *ints[a] = std::atoll(value().c_str());
      if (a != "--peak-size") o.shape.name = "custom";
    } else {
      usage("unknown option " + a);
    }
  }
  const plan::MoeBenchShape& s = o.shape;
  if (s.tokens < 1 || s.hidden < 1 || s.ffn < 1 || s.experts < 1 || s.topk < 1 ||
      s.topk > s.experts || s.shared_ffn < 0)
    usage("a shape needs tokens, hidden, ffn, experts >= 1 and 1 <= topk <= experts");
  return o;
}

std::string shape_text(const plan::MoeBenchShape& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s T=%lld H=%lld F=%lld E=%lld K=%lld Fs=%lld", s.name.c_str(),
                static_cast<long long>(s.tokens), static_cast<long long>(s.hidden),
                static_cast<long long>(s.ffn), static_cast<long long>(s.experts),
                static_cast<long long>(s.topk), static_cast<long long>(s.shared_ffn));
  return buf;
}

plan::DevicePeaks peaks_of(const Options& o) {
  plan::DevicePeaks p;
  if (o.peak_tflops > 0) p.bf16_tflops = o.peak_tflops;
  if (o.hbm_tbps > 0) p.hbm_tbps = o.hbm_tbps;
  return p;
}

// The prediction: one line per kernel (or a markdown row), then the sums.
void print_prediction(const Options& o) {
  const plan::DevicePeaks p = peaks_of(o);
  const auto kernels = plan::moe_layer_kernels(o.shape);
  std::printf(
      "# roofline of %s at %.0f TFLOP/s bf16, %.0f TFLOP/s f32, %.2f TB/s, %.0f us a "
      "launch, %.0f us a host sync\n",
      shape_text(o.shape).c_str(), p.bf16_tflops, p.fp32_tflops, p.hbm_tbps, p.launch_us,
      p.sync_us);
  double total[2] = {0, 0};
  std::map<std::string, double> by_group;
  for (const plan::KernelCost& k : kernels) {
    const double t = plan::predicted_seconds(k, p);
    total[k.pass == "bwd"] += t;
    by_group[k.group] += t;
    if (o.predict_only) {
      std::printf("| %s | %s | %.3g | %.3g | %.1f | %s | | |\n", k.pass.c_str(), k.name.c_str(),
                  k.flops, k.bytes, t * 1e6, plan::bound_by(k, p));
    } else {
      std::printf("[predict] %s %-46s %10.3g FLOP %10.3g B %9.1f us (%s)\n", k.pass.c_str(),
                  k.name.c_str(), k.flops, k.bytes, t * 1e6, plan::bound_by(k, p));
    }
  }
  const double flops = plan::moe_layer_model_flops(o.shape);
  std::printf(
      "[predict] %s: fwd %.3f ms | bwd %.3f ms | fwd+bwd %.3f ms | model FLOPs %.4g "
      "(%.3f ms at %.0f TFLOP/s)",
      o.shape.name.c_str(), total[0] * 1e3, total[1] * 1e3, (total[0] + total[1]) * 1e3, flops,
      flops / (p.bf16_tflops * 1e12) * 1e3, p.bf16_tflops);
  for (const auto& [g, t] : by_group) std::printf(" | %s %.3f ms", g.c_str(), t * 1e3);
  std::printf("\n");
}

// Fills a device f32 buffer with uniform values in [-a, a] from one host block, copied over.
void fill_random(const Exec& ex, DevPtr<float> dst, int64_t n, float a, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-a, a);
  std::vector<float> block(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 22)));
  for (float& v : block) v = d(gen);
  for (int64_t at = 0; at < n; at += static_cast<int64_t>(block.size())) {
    const int64_t m = std::min<int64_t>(static_cast<int64_t>(block.size()), n - at);
    ops::copy<float>(ex, dst + at, block.data(), m);
  }
  exec_synchronize(ex);  // the host block must outlive the copies
}

// Seconds per call of fn: one call to warm up, then `reps` calls between two synchronisations.
double seconds_per_call(const Exec& ex, const std::function<void()>& fn, int reps) {
  fn();
  exec_synchronize(ex);
  const double t0 = now();
  for (int r = 0; r < reps; ++r) fn();
  exec_synchronize(ex);
  return (now() - t0) / reps;
}

// The GEMM peak of this device at the run's precision: C[n, n] = A[n, n] B[n, n]^T, the best of
// five batches of calls (each batch about 50 ms or 3 calls).
double measure_peak_tflops(const Exec& ex, bool use_bf16, int64_t n) {
  Arena arena(ex);
  DevPtr<float> a32 = nullptr, b32 = nullptr, c = nullptr;
  DevPtr<bf16> a16 = nullptr, b16 = nullptr;
  arena.plan([&](Arena& a) {
    a32 = a.alloc<float>(n * n, "peak.a32", MemKind::Workspace);
    b32 = a.alloc<float>(n * n, "peak.b32", MemKind::Workspace);
    c = a.alloc<float>(n * n, "peak.c", MemKind::Workspace);
    if (use_bf16) {
      a16 = a.alloc<bf16>(n * n, "peak.a16", MemKind::Workspace);
      b16 = a.alloc<bf16>(n * n, "peak.b16", MemKind::Workspace);
    }
  });
  fill_random(ex, a32, n * n, 1.f, 11);
  fill_random(ex, b32, n * n, 1.f, 12);
  std::vector<float> ws(use_bf16 ? static_cast<size_t>(ops::gemm_bf16_workspace_elems(ex, n, n, n))
                                 : 0);
  if (use_bf16 && !ex.on_cpu() && !ws.empty())
    usage("internal: a device GEMM asked for host workspace");
  std::function<void()> gemm;
  if (use_bf16) {
    ops::cast_f32_to_bf16(ex, a16, a32, n * n);
    ops::cast_f32_to_bf16(ex, b16, b32, n * n);
    gemm = [&] {
      ops::gemm_bf16(ex, false, true, n, n, n, a16, n, b16, n, 0.f, c, n,
                     ws.empty() ? DevPtr<float>(nullptr) : DevPtr<float>(ws.data()));
    };
  } else {
    gemm = [&] { ops::gemm<float>(ex, false, true, n, n, n, 1.f, a32, n, b32, n, 0.f, c, n); };
  }
  const double one = seconds_per_call(ex, gemm, 1);
  const int reps = std::max(3, static_cast<int>(0.05 / std::max(one, 1e-6)));
  double best = 1e30;
  for (int b = 0; b < 5; ++b) best = std::min(best, seconds_per_call(ex, gemm, reps));
  return 2.0 * n * n * n / best / 1e12;
}

MoeLayerConfig layer_config(const plan::MoeBenchShape& s) {
  MoeLayerConfig cfg;
  cfg.hidden = s.hidden;
  cfg.num_experts = s.experts;
  cfg.seq_length = s.tokens;  // one sequence (Megatron's perf test: seq 4096, micro-batch 1)
  cfg.init_std = 0.02;
  cfg.output_init_std = 0.02;
  cfg.activation = ops::Activation::SwiGLU;
  cfg.add_mlp_bias = false;
  RouterConfig& r = cfg.moe.router;
  r.num_experts = s.experts;
  r.topk = s.topk;
  r.score = s.sigmoid ? ScoreFunction::Sigmoid : ScoreFunction::Softmax;
  r.enable_expert_bias = s.sigmoid;
  r.num_groups = s.groups;
  r.group_topk = s.group_topk;
  r.load_balancing = s.seq_aux_loss ? LoadBalancing::SeqAuxLoss : LoadBalancing::AuxLoss;
  r.aux_loss_coeff = 1.0;  // the perf test's moe_aux_loss_coeff
  r.dtype = RouterDType::F32;
  cfg.moe.ffn_hidden = s.ffn;
  cfg.moe.shared_ffn_hidden = s.shared_ffn;
  cfg.moe.dispatcher_type = DispatcherType::AlltoAll;  // one rank: the local dispatcher
  return cfg;
}

// The buffers of the --kernels runs: raw f32-sized blocks, read as f32 or bf16.
struct KernelBuffers {
  DevPtr<float> a = nullptr, b = nullptr, c = nullptr, d = nullptr;  // N x max(H, F1) each
  DevPtr<float> p = nullptr, dp = nullptr;                           // [N]
  DevPtr<float> x_TH = nullptr;                                      // [T, H]
  DevPtr<int64_t> rows_1 = nullptr;                                  // one group of T rows
  ops::GroupedGemmWorkspace gws;  // the device-table path's, for E groups (or one)
};

struct Measured {
  std::string pass, name;
  double seconds;
};

// The expert and dispatch kernels of the layer, each alone at the layer's shapes: the group sizes
// and permutation of the layer's last forward, the layer's own weights and gradients.
std::vector<Measured> time_kernels(const Exec& ex, const Options& o,
                                   const moe::MoELayer<float>& layer, ParamRegistry& params,
                                   const KernelBuffers& kb, int reps) {
  const plan::MoeBenchShape& s = o.shape;
  const int64_t T = s.tokens, H = s.hidden, F = s.ffn, F1 = 2 * F, E = s.experts, K = s.topk;
  const int64_t N = T * K, Fs = s.shared_ffn;
  const moe::DispatchPlan& plan = layer.plan();
  const DevPtr<const int64_t> m_G = plan.tokens_per_expert_L;
  const Param& fc1 = layer.experts().fc1();
  const Param& fc2 = layer.experts().fc2();
  std::vector<Measured> out;
  auto time = [&](const char* pass, const char* name, const std::function<void()>& fn) {
    out.push_back({pass, name, seconds_per_call(ex, fn, reps)});
  };
  const bool b16 = o.bf16;
  auto h16 = [](DevPtr<float> p) { return dev_ptr_cast<bf16>(p); };
  // Data: f32 blocks of values, their bf16 casts.
  const int64_t wide = N * std::max(H, F1);
  fill_random(ex, kb.c, wide, 0.5f, 21);
  fill_random(ex, kb.d, wide, 0.5f, 22);
  fill_random(ex, kb.p, N, 0.5f, 23);
  fill_random(ex, kb.x_TH, T * H, 0.5f, 24);
  if (b16) {
    ops::cast_f32_to_bf16(ex, h16(kb.a), kb.c, wide);
    ops::cast_f32_to_bf16(ex, h16(kb.b), kb.d, wide);
  } else {
    ops::copy<float>(ex, kb.a, kb.c, wide);
    ops::copy<float>(ex, kb.b, kb.d, wide);
  }
  const ops::GroupedGemmWorkspace gws = kb.gws;
  if (b16) {
    // The layer's --bf16 kernels (plan/moe_layer_kernels.h), in its order: x [T, H] cast once,
    // bf16 rows gathered, fc1 writing the bf16 h, the activation from it, fc2's f32 rows rounded
    // for the way back and summed per token; the backward likewise. Rows: a holds the expert
    // input rows (bf16), b the bf16 h, c the bf16 activation then f32 gradients, d the f32
    // products and then the bf16 dh.
    time("fwd", "dispatch: cast x to bf16",
         [&] { ops::cast_f32_to_bf16(ex, h16(kb.c), kb.x_TH, T * H); });
    time("fwd", "dispatch: permute bf16 rows + probs", [&] {
      ops::permute_rows<bf16>(ex, h16(kb.a), h16(kb.c), plan.row_token_N, N, H);
    });
    time("fwd", "experts: fc1 grouped GEMM", [&] {
      ops::grouped_gemm_bf16_out(ex, m_G, E, F1, H, N, h16(kb.a), fc1.data16, true, nullptr,
                                 h16(kb.b), kb.d, nullptr, nullptr, gws);
    });
    time("fwd", "experts: SwiGLU x prob to bf16",
         [&] { ops::swiglu_forward_bf16(ex, h16(kb.c), h16(kb.b), kb.p, N, F); });
    time("fwd", "experts: fc2 grouped GEMM", [&] {
      ops::grouped_gemm_bf16(ex, m_G, E, H, F, h16(kb.c), fc2.data16, true, kb.d, nullptr, nullptr,
                             gws);
    });
    time("fwd", "combine: round rows to bf16",
         [&] { ops::cast_f32_to_bf16(ex, h16(kb.c), kb.d, N * H); });
    time("fwd", "combine: unpermute rows (sum of K)", [&] {
      ops::unpermute_rows(ex, kb.x_TH, DevPtr<const bf16>(h16(kb.c)), plan.token_rows_TK, T, K, H);
    });
    time("bwd", "combine bwd: cast dy to bf16",
         [&] { ops::cast_f32_to_bf16(ex, h16(kb.c), kb.x_TH, T * H); });
    time("bwd", "combine bwd: permute dy rows", [&] {
      ops::permute_rows<bf16>(ex, h16(kb.d), h16(kb.c), plan.row_token_N, N, H);
    });
    time("bwd", "experts: fc2 dgrad", [&] {
      ops::grouped_gemm_bf16(ex, m_G, E, F, H, h16(kb.d), fc2.data16, false, kb.c, nullptr, nullptr,
                             gws);
    });
    time("bwd", "experts: fc2 wgrad (f32 accumulate)", [&] {
      ops::grouped_gemm_wgrad_bf16(ex, m_G, E, H, F, h16(kb.d), h16(kb.b), fc2.grad_as<float>(),
                                   nullptr, gws);
    });
    time("bwd", "experts: SwiGLU backward to bf16", [&] {
      ops::swiglu_backward_bf16(ex, h16(kb.d), kb.dp, kb.c, h16(kb.b), kb.p, N, F);
    });
    time("bwd", "experts: fc1 dgrad", [&] {
      ops::grouped_gemm_bf16(ex, m_G, E, H, F1, h16(kb.d), fc1.data16, false, kb.c, nullptr,
                             nullptr, gws);
    });
    time("bwd", "experts: fc1 wgrad (f32 accumulate)", [&] {
      ops::grouped_gemm_wgrad_bf16(ex, m_G, E, F1, H, h16(kb.d), h16(kb.a), fc1.grad_as<float>(),
                                   nullptr, gws);
    });
    time("bwd", "dispatch bwd: round dx rows to bf16",
         [&] { ops::cast_f32_to_bf16(ex, h16(kb.b), kb.c, N * H); });
    time("bwd", "dispatch bwd: unpermute dx rows + dprobs", [&] {
      ops::unpermute_rows(ex, kb.x_TH, DevPtr<const bf16>(h16(kb.b)), plan.token_rows_TK, T, K, H);
    });
    if (Fs > 0) {
      const std::string pre = "moe.shared_experts.";
      const Param& s1 = params.get(pre + "linear_fc1.weight");
      const Param& s2 = params.get(pre + "linear_fc2.weight");
      time("fwd", "shared: fc1 GEMM", [&] {
        ops::grouped_gemm_bf16_out(ex, kb.rows_1, 1, 2 * Fs, H, T, h16(kb.a), s1.data16, true,
                                   nullptr, h16(kb.b), kb.d, nullptr, nullptr, gws, T);
      });
      time("fwd", "shared: fc2 GEMM", [&] {
        ops::grouped_gemm_bf16(ex, kb.rows_1, 1, H, Fs, h16(kb.b), s2.data16, true, kb.c, nullptr,
                               nullptr, gws, T);
      });
      time("bwd", "shared: fc1 wgrad (f32 accumulate)", [&] {
        ops::grouped_gemm_wgrad_bf16(ex, kb.rows_1, 1, 2 * Fs, H, h16(kb.b), h16(kb.a),
                                     s1.grad_as<float>(), nullptr, gws, T);
      });
    }
  } else {  // f32 (no --bf16): the same products in f32, the f32 rows gathered
    time("fwd", "dispatch: permute rows + probs",
         [&] { ops::permute_rows<float>(ex, kb.c, kb.x_TH, plan.row_token_N, N, H); });
    time("fwd", "combine: unpermute rows (sum of K)",
         [&] { ops::unpermute_rows<float>(ex, kb.x_TH, kb.c, plan.token_rows_TK, T, K, H); });
    time("fwd", "experts: fc1 grouped GEMM", [&] {
      ops::grouped_gemm<float>(ex, m_G, E, F1, H, kb.a, fc1.data_as<float>(), true, kb.d, gws);
    });
    time("fwd", "experts: SwiGLU x prob",
         [&] { ops::swiglu_forward<float>(ex, kb.b, kb.d, kb.p, N, F); });
    time("fwd", "experts: fc2 grouped GEMM", [&] {
      ops::grouped_gemm<float>(ex, m_G, E, H, F, kb.b, fc2.data_as<float>(), true, kb.c, gws);
    });
    time("bwd", "experts: fc2 dgrad", [&] {
      ops::grouped_gemm<float>(ex, m_G, E, F, H, kb.a, fc2.data_as<float>(), false, kb.c, gws);
    });
    time("bwd", "experts: fc2 wgrad (f32 accumulate)", [&] {
      ops::grouped_gemm_wgrad<float>(ex, m_G, E, H, F, kb.a, kb.b, fc2.grad_as<float>(), gws);
    });
    time("bwd", "experts: fc1 wgrad (f32 accumulate)", [&] {
      ops::grouped_gemm_wgrad<float>(ex, m_G, E, F1, H, kb.b, kb.a, fc1.grad_as<float>(), gws);
    });
  }
  return out;
}

}  // namespace

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const plan::MoeBenchShape& s = o.shape;
  if (o.predict_only) {
    print_prediction(o);
    return 0;
  }
  const Device dev = parse_device(o.device);
  const Exec ex = make_exec(dev);
  const char* dtype = o.bf16 ? "bf16" : "fp32";
  const std::string where = dev == Device::CUDA ? cuda_device_info().description : "the CPU";
  std::printf("# bench_moe_layer on %s: %s, %s, %d iterations after %d warm-up\n", where.c_str(),
              shape_text(s).c_str(), dtype, o.iters, o.warmup);
  std::fflush(stdout);

  // The GEMM peak first, its buffers freed before the layer's.
  double peak = o.peak_tflops;
  const char* peak_how = "given";
  if (peak <= 0) {
    const int64_t n = o.peak_size > 0 ? o.peak_size : dev == Device::CUDA ? 8192 : 256;
    peak = measure_peak_tflops(ex, o.bf16, n);
    peak_how = "measured";
    std::printf("[gemm-peak] moecore %s %s %lldx%lldx%lld: %.3f TFLOP/s (best of 5 batches)\n",
                o.device.c_str(), dtype, static_cast<long long>(n), static_cast<long long>(n),
                static_cast<long long>(n), peak);
    std::fflush(stdout);
  }

  const int64_t T = s.tokens, H = s.hidden;
  ParamRegistry params(DType::F32);
  if (o.bf16) {  // as the model sets it up (model/gpt_model.cpp)
    params.enable_bf16_copies(ops::bf16_gemm_path(ex) == ops::Bf16GemmPath::Widen);
  }
  const MoeLayerConfig cfg = layer_config(s);
  moe::MoELayer<float> layer(cfg, params, "moe");
  const double t_init = now();
  Arena arena(ex);
  DevPtr<float> x = nullptr, dy = nullptr, y = nullptr, dx = nullptr;
  KernelBuffers kb;
  const int64_t N = T * s.topk, wide = N * std::max(H, 2 * s.ffn);
  arena.plan([&](Arena& a) {
    params.allocate(a);
    layer.allocate(a, T);
    x = a.alloc<float>(T * H, "bench.x");
    dy = a.alloc<float>(T * H, "bench.dy");
    y = a.alloc<float>(T * H, "bench.y", MemKind::Workspace);
    dx = a.alloc<float>(T * H, "bench.dx", MemKind::Workspace);
    if (o.kernels) {
      for (DevPtr<float>* b : {&kb.a, &kb.b, &kb.c, &kb.d})
        *b = a.alloc<float>(wide, "bench.kernels", MemKind::Workspace);
      kb.p = a.alloc<float>(N, "bench.kernels.p", MemKind::Workspace);
      kb.dp = a.alloc<float>(N, "bench.kernels.dp", MemKind::Workspace);
      kb.x_TH = a.alloc<float>(T * H, "bench.kernels.x", MemKind::Workspace);
      kb.rows_1 = a.alloc<int64_t>(1, "bench.kernels.rows", MemKind::Workspace);
      // The device-table path's table and backend workspace, as the layer plans its own.
      if (const int64_t bytes = ops::grouped_gemm_workspace_bytes(ex, s.experts); bytes > 0)
        kb.gws = {a.alloc<std::byte>(bytes, "bench.kernels.gws", MemKind::Workspace), bytes};
    }
  });
  params.init(1234);
  if (o.bf16) params.refresh_bf16();
  // Activations of O(1), as a normalised hidden state (Megatron's test: randn).
  fill_random(ex, x, T * H, 1.7f, 1);
  fill_random(ex, dy, T * H, 1.7f, 2);
  if (o.kernels) ops::copy<int64_t>(ex, kb.rows_1, &T, 1);
  exec_synchronize(ex);
  std::printf(
      "# set-up %.1f s: %.2f GiB planned (%lld parameters)\n", now() - t_init,
      arena.planned_bytes() / 1073741824.0,
      static_cast<long long>(params.numel(ParamKind::Dense) + params.numel(ParamKind::Expert)));
  std::fflush(stdout);

  auto step = [&](double* fwd_s, double* bwd_s) {
    params.zero_grads();
    exec_synchronize(ex);
    const double t0 = now();
    layer.forward(y, x, T);
    exec_synchronize(ex);
    const double t1 = now();
    layer.backward(dx, dy, 1.0);
    exec_synchronize(ex);
    const double t2 = now();
    layer.finish_step();  // the expert-bias update: the optimizer step's, not the layer's
    if (fwd_s) *fwd_s = t1 - t0;
    if (bwd_s) *bwd_s = t2 - t1;
  };
  for (int i = 0; i < o.warmup; ++i) step(nullptr, nullptr);
  std::vector<double> fwd, bwd, both;
  for (int i = 0; i < o.iters; ++i) {
    double f = 0, b = 0;
    step(&f, &b);
    fwd.push_back(f);
    bwd.push_back(b);
    both.push_back(f + b);
  }
  const double flops = plan::moe_layer_model_flops(s);
  const double t = median(both);
  const double tflops = flops / t / 1e12;
  std::printf(
      "[moe-layer] moecore %s %s %s: fwd %.3f ms | bwd %.3f ms | fwd+bwd %.3f ms | "
      "%.3f TFLOP/s | %.1f%% of %.1f TFLOP/s peak (%s)\n",
      o.device.c_str(), dtype, shape_text(s).c_str(), median(fwd) * 1e3, median(bwd) * 1e3, t * 1e3,
      tflops, 100.0 * tflops / peak, peak, peak_how);
  std::fflush(stdout);

  // The phase breakdown, from a few more iterations with the phase profiler on.
  {
    PhaseProfiler prof(make_phase_timer(ex, 1 << 14));
    std::array<double, kNumPhases> sum{};
    double wall = 0, marked = 0;
    const int n = std::min(o.iters, 3);
    {
      ActiveProfiler active(&prof);
      for (int i = 0; i < n; ++i) {
        prof.reset();
        double f = 0, b = 0;
        step(&f, &b);
        wall += f + b;
        for (int p = 0; p < kNumPhases; ++p) sum[p] += prof.seconds(static_cast<Phase>(p));
      }
    }
    std::printf("[moe-layer] phases of fwd+bwd (profiler, %d iterations):", n);
    bool first = true;
    for (int p = 0; p < kNumPhases; ++p) {
      if (sum[p] <= 0) continue;
      std::printf("%s %s %.3f ms", first ? "" : ",",
                  std::string(phase_name(static_cast<Phase>(p))).c_str(), sum[p] / n * 1e3);
      marked += sum[p];
      first = false;
    }
    // What no region marks: on CUDA the experts and the shared expert (GEMMs, casts, SwiGLU),
    // whose ops mark no phase there; on the CPU the element-wise work around the GEMMs.
    std::printf("%s unmarked %.3f ms (of %.3f ms)\n", first ? "" : ",",
                std::max(0.0, wall - marked) / n * 1e3, wall / n * 1e3);
  }

  if (o.kernels) {
    const bool native = !o.bf16 || ops::bf16_gemm_path(ex) == ops::Bf16GemmPath::Native;
    if (!native) {
      std::printf(
          "[kernel] NOT RUN: the widened-bf16 GEMM path of this CPU (the kernels timed "
          "are the native path's)\n");
    } else {
      const plan::DevicePeaks p = peaks_of(o);
      std::map<std::string, double> predicted;
      std::map<std::string, const char*> bound;
      for (const plan::KernelCost& k : plan::moe_layer_kernels(s)) {
        predicted[k.pass + " " + k.name] = plan::predicted_seconds(k, p);
        bound[k.pass + " " + k.name] = plan::bound_by(k, p);
      }
      for (const Measured& m : time_kernels(ex, o, layer, params, kb, std::max(3, o.iters))) {
        const std::string key = m.pass + " " + m.name;
        if (o.bf16 && dev == Device::CUDA && predicted.count(key)) {
          std::printf("[kernel] %s: %.3f ms, predicted %.3f ms (%s), x%.2f\n", key.c_str(),
                      m.seconds * 1e3, predicted[key] * 1e3, bound[key],
                      m.seconds / predicted[key]);
        } else {
          std::printf("[kernel] %s: %.3f ms\n", key.c_str(), m.seconds * 1e3);
        }
      }
    }
  }
  if (o.predict) print_prediction(o);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // e.g. out of device memory: one line for the check's log
    std::fflush(stdout);
    std::fprintf(stderr, "bench_moe_layer: error: %s\n", e.what());
    return 1;
  }
}
