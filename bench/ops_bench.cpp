// Element-wise ops and the optimizer at the bench-small shapes (bench/small.toml: 2,048 tokens,
// hidden 512, 16 experts top-2 with ffn 512, vocab 8192, 64.5M parameters): median ms per call
// and the GB/s of the bytes each op must move (its inputs read once, its outputs written once).
//   OMP_NUM_THREADS=2 build/bench_ops [seconds per op, default 0.3] [only rows containing this]
// The head + cross entropy rows time the whole op and subtract its GEMMs (the profiler's GEMM
// phase), so "ms" there is the softmax / loss / gradient work alone; GB/s counts one read of
// the logits (forward) or one read and one write of them (backward). The optimizer row counts
// the norm's read of g and AdamW's read of p, g, m, v and write of p, m, v (and of the bf16 copy).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "core/profiler.h"
#include "ops/adamw.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"
#include "optim/chained_optimizer.h"
#include "optim/optimizer.h"

#include "bench_timing.h"

using namespace moecore;

namespace {

using bench_timing::median;
using bench_timing::now;

double g_seconds = 0.3;
std::string g_filter;

// Median seconds of fn() (minus what `exclude` reports for the same call) over >= 5 calls
// and >= g_seconds, after one warm-up call.
double time_op(const std::function<void()>& fn, const std::function<double()>& exclude = {}) {
  fn();
  if (exclude) exclude();  // drop the warm-up call's share
  std::vector<double> t;
  const double t_end = now() + g_seconds;
  while (t.size() < 5 || now() < t_end) {
    const double t0 = now();
    fn();
    double dt = now() - t0;
    if (exclude) dt -= exclude();
    t.push_back(dt);
  }
  return median(t);
}

// Times fn (see time_op) and prints one table row, unless the row is filtered out.
void bench(const char* name, const std::string& shape, double bytes,
           const std::function<void()>& fn, const std::function<double()>& exclude = {}) {
  if (std::string(name).find(g_filter) == std::string::npos) return;
  const double s = time_op(fn, exclude);
  std::printf("| %-26s | %-29s | %9.3f | %6.1f |\n", name, shape.c_str(), s * 1e3,
              bytes / s * 1e-9);
}

template <typename T>
std::vector<T> rand_vec(int64_t n, uint32_t seed, double lo = -1, double hi = 1) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(gen));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_seconds = std::atof(argv[1]);
  if (argc > 2) g_filter = argv[2];
  const int64_t T = 2048, H = 512, F = 512, K = 2, V = 8192, D = 64, Hq = 8, Hkv = 2;
  const int64_t N = T * K;  // routed expert rows
  constexpr double f4 = 4, b2 = 2;
  std::printf("| op | shape | ms | GB/s |\n| --- | --- | ---: | ---: |\n");

  {  // SwiGLU over the routed rows (with the routing probability) as the grouped experts run it.
    auto h = rand_vec<float>(N * 2 * F, 1, -4, 4), p = rand_vec<float>(N, 2, 0, 1);
    auto da = rand_vec<float>(N * F, 3);
    std::vector<float> a(N * F), dh(N * 2 * F), dp(N);
    bench("swiglu_forward", "N=4096 F=512 with p", f4 * (N * 2 * F + N + N * F),
          [&] { ops::swiglu_forward<float>(cpu_exec(), a.data(), h.data(), p.data(), N, F); });
    bench("swiglu_backward", "N=4096 F=512 with p", f4 * (N * 2 * F + 2 * N + N * F + N * 2 * F),
          [&] {
            ops::swiglu_backward<float>(cpu_exec(), dh.data(), dp.data(), da.data(), h.data(),
                                        p.data(), N, F);
          });
  }
  {  // Output head + cross entropy (the model's chunk of 1024 tokens), GEMMs subtracted.
    ops::HeadLossShape s{T, H, V, 1024};
    auto h = rand_vec<float>(T * H, 4), w = rand_vec<float>(V * H, 5, -0.05, 0.05);
    std::vector<int32_t> tgt(T);
    for (int64_t t = 0; t < T; ++t) tgt[t] = static_cast<int32_t>((t * 7919) % V);
    std::vector<float> loss(T), lse(T), ws(ops::head_loss_workspace_elems(s)), dh(T * H), dw(V * H);
    std::vector<bf16> w16(V * H), h16(T * H), dz16(ops::head_loss_workspace_elems(s));
    ops::cast_f32_to_bf16(cpu_exec(), w16.data(), w.data(), V * H);
    std::vector<float> ws32(ops::head_loss_bf16_workspace_elems(cpu_exec(), s));
    ops::HeadLossBf16 hb{w16.data(), h16.data(), dz16.data(), ws32.data()};
    PhaseProfiler prof;
    ActiveProfiler active(&prof);
    auto gemm_s = [&] {
      const double g = prof.seconds(Phase::Gemm);
      prof.reset();
      return g;
    };
    double loss_sum = 0;
    const float dloss = 1.f / T;
    for (const ops::HeadLossBf16* b : {static_cast<const ops::HeadLossBf16*>(nullptr),
                                       static_cast<const ops::HeadLossBf16*>(&hb)}) {
      const std::string shape = std::string("T=2048 V=8192 chunk=1024") + (b ? " bf16" : "");
      bench(
          "head_loss_forward - GEMM", shape, f4 * T * V,
          [&] {
            ops::head_loss_forward<float>(cpu_exec(), &loss_sum, loss.data(), lse.data(), h.data(),
                                          w.data(), tgt.data(), s, ws.data(), b);
          },
          gemm_s);
      bench(
          "head_loss_backward - GEMMs", shape, f4 * T * V + (b ? b2 : f4) * T * V,
          [&] {
            ops::head_loss_backward<float>(cpu_exec(), dh.data(), dw.data(), h.data(), w.data(),
                                           tgt.data(), lse.data(), &dloss, s, ws.data(), b);
          },
          gemm_s);
    }
  }
  {
    auto x = rand_vec<float>(T * H, 6), w = rand_vec<float>(H, 7), dy = rand_vec<float>(T * H, 8);
    std::vector<float> y(T * H), rstd(T), dx(T * H), dw(H);
    bench("rmsnorm_forward", "T=2048 H=512", f4 * (2 * T * H + T), [&] {
      ops::rmsnorm_forward<float>(cpu_exec(), y.data(), rstd.data(), x.data(), w.data(), T, H,
                                  1e-6);
    });
    bench("rmsnorm_backward", "T=2048 H=512", f4 * (3 * T * H + T), [&] {
      ops::rmsnorm_backward<float>(cpu_exec(), dx.data(), dw.data(), dy.data(), x.data(), w.data(),
                                   rstd.data(), T, H);
    });
  }
  {  // RoPE in place on q (8 heads; k has 2), token t = s * B + b at position t / 8.
    const ops::RopeTables cache(256, D, 10000.0);
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t / 8);
    auto q = rand_vec<float>(T * Hq * D, 9);
    bench("rope_forward (q)", "T=2048 heads=8 D=64", f4 * 2 * T * Hq * D, [&] {
      ops::rope_forward<float>(cpu_exec(), q.data(), q.data(), pos.data(), T, Hq, cache);
    });
    bench("rope_backward (q)", "T=2048 heads=8 D=64", f4 * 2 * T * Hq * D, [&] {
      ops::rope_backward<float>(cpu_exec(), q.data(), q.data(), pos.data(), T, Hq, cache);
    });
  }
  {  // The largest bf16 GEMM input: dh of the routed experts.
    auto x = rand_vec<float>(N * 2 * F, 10);
    std::vector<bf16> y(N * 2 * F);
    std::vector<float> z(N * 2 * F);
    bench("cast_f32_to_bf16", "4096 x 1024", (f4 + b2) * N * 2 * F,
          [&] { ops::cast_f32_to_bf16(cpu_exec(), y.data(), x.data(), N * 2 * F); });
    bench("cast_bf16_to_f32", "4096 x 1024", (f4 + b2) * N * 2 * F,
          [&] { ops::cast_bf16_to_f32(cpu_exec(), z.data(), y.data(), N * 2 * F); });
  }
  {
    auto w = rand_vec<float>(V * H, 11), dy = rand_vec<float>(T * H, 12);
    std::vector<float> y(T * H), dw(V * H);
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>((t * 104729) % V);
    bench("embedding_forward", "T=2048 H=512 V=8192", f4 * 2 * T * H, [&] {
      ops::embedding_forward<float>(cpu_exec(), y.data(), ids.data(), w.data(), T, H, V);
    });
    bench("embedding_backward", "T=2048 H=512 V=8192", f4 * 3 * T * H, [&] {
      ops::embedding_backward<float>(cpu_exec(), dw.data(), dy.data(), ids.data(), T, H, V);
    });
  }
  // The optimizer over bench-small's parameters (the model's shapes and kinds).
  // Compute copies: none (fp32), bf16 (native bf16 GEMMs), bf16 values widened to f32 (widen).
  for (int copies : {0, 1, 2}) {
    const bool bf16_copies = copies > 0;
    ParamRegistry params(DType::F32);
    if (bf16_copies) params.enable_bf16_copies(/*widened=*/copies == 2);
    auto add = [&](const std::string& name, std::vector<int64_t> shape, ParamKind kind, bool wd) {
      params.add(ParamSpec{name, std::move(shape), ParamInit::Normal, 0.02, kind, wd, {}});
    };
    add("embedding", {V, H}, ParamKind::Dense, true);
    for (int l = 0; l < 4; ++l) {
      const std::string p = "layers." + std::to_string(l);
      add(p + ".norm1", {H}, ParamKind::Dense, false);
      add(p + ".qkv", {(Hq + 2 * Hkv) * D, H}, ParamKind::Dense, true);
      add(p + ".proj", {H, Hq * D}, ParamKind::Dense, true);
      add(p + ".norm2", {H}, ParamKind::Dense, false);
      add(p + ".router", {16, H}, ParamKind::Dense, true);
      add(p + ".shared.fc1", {2 * F, H}, ParamKind::Dense, true);
      add(p + ".shared.fc2", {H, F}, ParamKind::Dense, true);
      add(p + ".experts.fc1", {16, 2 * F, H}, ParamKind::Expert, true);
      add(p + ".experts.fc2", {16, H, F}, ParamKind::Expert, true);
    }
    add("final_norm", {H}, ParamKind::Dense, false);
    add("head", {V, H}, ParamKind::Dense, true);
    Arena arena;
    arena.plan([&](Arena& a) { params.allocate(a); });
    params.init(1);
    auto fill_grads = [&] {
      for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
        float* g = static_cast<float*>(raw_ptr(params.flat_grad(k)));
        for (int64_t i = 0; i < params.numel(k); ++i) g[i] = 1e-3f * float(i % 97 - 48);
      }
    };
    fill_grads();
    const double n =
        static_cast<double>(params.numel(ParamKind::Dense) + params.numel(ParamKind::Expert));
    optim::AdamWConfig cfg;
    cfg.weight_decay = 0.1;
    optim::ChainedOptimizer opt(params, cfg);
    char shape[64];
    std::snprintf(shape, sizeof(shape), "%.1fM params%s", n * 1e-6,
                  copies == 0   ? ""
                  : copies == 1 ? " bf16"
                                : " bf16 widened");
    const double copy_bytes = copies == 0 ? 0.0 : copies == 1 ? b2 * n : f4 * n;
    if (!bf16_copies) {
      bench("grad sum of squares", shape, f4 * n, [&] {
        volatile double s = optim::global_grad_norm(params);
        (void)s;
      });
      bench("zero_grads", shape, f4 * n, [&] { params.zero_grads(); });
      fill_grads();
    }
    // One optimizer step as the trainer runs it: the step (norm + update), then the refresh.
    bench("optimizer step + refresh", shape, f4 * 8 * n + copy_bytes, [&] {
      opt.step(1e-4);
      params.refresh_bf16();
    });
    if (bf16_copies) {
      bench("refresh_bf16 alone", shape, f4 * n + copy_bytes, [&] { params.refresh_bf16(); });
    }
  }
  return 0;
}
