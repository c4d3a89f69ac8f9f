// Causal GQA attention (fp32 fast path): ms per call and GFLOP/s of attention_forward and
// attention_backward at one shape, at the current OpenMP thread count. bench/RESULTS.md.
//
//   bench_attention [--S 256] [--B 8] [--Hq 8] [--Hkv 2] [--D 64] [--seconds 1] [--dropout 0]
//
// --dropout p: attention dropout of the probabilities (0: none, the op gets no AttentionDropout).
//
// FLOPs count only the causal half (key j <= query i), per (b, query head):
//   forward  4 * D * S(S+1)/2   (Q K^T and P V)
//   backward 10 * D * S(S+1)/2  (Q K^T recomputed, dO V^T, P^T dO, dS K, dS^T Q)
// Each rate is the median over calls (ops::measure_gflops); ms per call is derived from it.
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "ops/attention.h"
#include "ops/gemm_probe.h"

namespace {

std::vector<float> rand_vec(int64_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  moecore::ops::AttentionShape s{256, 8, 8, 2, 64};
  double seconds = 1.0, dropout = 0.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--S")
      s.S = std::atoll(v);
    else if (a == "--B")
      s.B = std::atoll(v);
    else if (a == "--Hq")
      s.Hq = std::atoll(v);
    else if (a == "--Hkv")
      s.Hkv = std::atoll(v);
    else if (a == "--D")
      s.D = std::atoll(v);
    else if (a == "--seconds")
      seconds = std::atof(v);
    else if (a == "--dropout")
      dropout = std::atof(v);
    else {
      std::fprintf(stderr, "bench_attention: unknown option %s (see the header comment)\n",
                   a.c_str());
      return 2;
    }
  }
  const int64_t n_q = s.S * s.B * s.Hq * s.D, n_kv = s.S * s.B * s.Hkv * s.D;
  const int64_t n_lse = s.B * s.Hq * s.S;
  // Scores of O(1), as in the tests: q, k in [-2, 2].
  const auto q = rand_vec(n_q, 1, -2.f, 2.f), k = rand_vec(n_kv, 2, -2.f, 2.f);
  const auto v = rand_vec(n_kv, 3, -1.f, 1.f), dout = rand_vec(n_q, 4, -1.f, 1.f);
  std::vector<float> out(n_q), lse(n_lse), dq(n_q), dk(n_kv), dv(n_kv);
  std::vector<float> ws(moecore::ops::attention_workspace_elems(s, omp_get_max_threads()));

  const moecore::ops::DropoutCounters counters{1, 0};
  const moecore::ops::AttentionDropout drop_args{dropout, 0x5eedull, &counters, 0};
  const moecore::ops::AttentionDropout* drop = dropout > 0 ? &drop_args : nullptr;

  const double pairs = static_cast<double>(s.B * s.Hq) * s.S * (s.S + 1) / 2.0;
  const double fwd_flops = 4.0 * s.D * pairs, bwd_flops = 10.0 * s.D * pairs;
  const double fwd = moecore::ops::measure_gflops(
      [&] {
        moecore::ops::attention_forward<float>(moecore::cpu_exec(), out.data(), lse.data(), q.data(),
                                               k.data(), v.data(), s, ws.data(), drop);
      },
      fwd_flops, seconds);
  const double bwd = moecore::ops::measure_gflops(
      [&] {
        moecore::ops::attention_backward<float>(moecore::cpu_exec(), dq.data(), dk.data(), dv.data(),
                                                dout.data(), q.data(), k.data(), v.data(),
                                                out.data(), lse.data(), s, ws.data(), drop);
      },
      bwd_flops, seconds);

  std::printf("# attention fp32 S=%lld B=%lld Hq=%lld Hkv=%lld D=%lld dropout=%g threads=%d\n",
              static_cast<long long>(s.S), static_cast<long long>(s.B),
              static_cast<long long>(s.Hq), static_cast<long long>(s.Hkv),
              static_cast<long long>(s.D), dropout, omp_get_max_threads());
  std::printf("# FLOPs per (b, query head): fwd 4*D*S(S+1)/2, bwd 10*D*S(S+1)/2 (causal half)\n");
  std::printf("forward   %8.3f ms  %7.1f GFLOP/s\n", fwd_flops / fwd * 1e-6, fwd);
  std::printf("backward  %8.3f ms  %7.1f GFLOP/s\n", bwd_flops / bwd * 1e-6, bwd);
  std::printf("fwd+bwd   %8.3f ms  %7.1f GFLOP/s\n",
              fwd_flops / fwd * 1e-6 + bwd_flops / bwd * 1e-6,
              (fwd_flops + bwd_flops) / (fwd_flops / fwd + bwd_flops / bwd));
  return 0;
}
