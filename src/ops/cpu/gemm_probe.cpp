// GEMM peak probe (see gemm_probe.h): times oneDNN sgemm (f32) or oneDNN's bf16 matmul at one
// shape. Median rather than mean or max: the machine is shared, so the mean is dragged by
// preempted calls and the max by lucky ones.
#include "ops/gemm_probe.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops {

double measure_gflops(const std::function<void()>& fn, double flops_per_call, double min_seconds) {
  using clock = std::chrono::steady_clock;
  fn();  // warm-up: first-call costs (page faults, JIT, thread pool start) are not the rate
  std::vector<double> rates;
  auto start = clock::now();
  while (rates.size() < 3 ||
         std::chrono::duration<double>(clock::now() - start).count() < min_seconds) {
    auto t0 = clock::now();
    fn();
    double s = std::chrono::duration<double>(clock::now() - t0).count();
    rates.push_back(flops_per_call / std::max(s, 1e-12) * 1e-9);
  }
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

double measure_gemm_gflops(bool use_bf16, int64_t M, int64_t N, int64_t K, double min_seconds) {
  MOE_CHECK(M > 0 && N > 0 && K > 0, "[gemm_probe] shape M={} N={} K={} must be positive", M, N, K);
  std::mt19937 gen(1234);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> a(M * K), b(K * N), c(M * N, 0.f);
  for (auto& v : a) v = dist(gen);
  for (auto& v : b) v = dist(gen);
  double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);

  if (!use_bf16) {
    return measure_gflops(
        [&] {
          dnnl_status_t st =
              dnnl_sgemm('N', 'N', M, N, K, 1.f, a.data(), K, b.data(), N, 0.f, c.data(), N);
          MOE_CHECK(st == dnnl_success, "[gemm_probe] dnnl_sgemm status {} at M={} N={} K={}",
                    static_cast<int>(st), M, N, K);
        },
        flops, min_seconds);
  }

  std::vector<moecore::bf16> a16(a.size()), b16(b.size());
  cpu::cast_f32_to_bf16(a16.data(), a.data(), static_cast<int64_t>(a.size()));
  cpu::cast_f32_to_bf16(b16.data(), b.data(), static_cast<int64_t>(b.size()));
  using dnnl::memory;
  try {
    dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    dnnl::stream strm(eng);
    memory::desc a_md({M, K}, memory::data_type::bf16, memory::format_tag::ab);
    memory::desc b_md({K, N}, memory::data_type::bf16, memory::format_tag::ab);
    memory::desc c_md({M, N}, memory::data_type::f32, memory::format_tag::ab);
#if DNNL_VERSION_MAJOR >= 3
    dnnl::matmul::primitive_desc pd(eng, a_md, b_md, c_md);
#else
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), eng);
#endif
    dnnl::matmul mm(pd);
    memory a_mem(a_md, eng, a16.data()), b_mem(b_md, eng, b16.data());
    memory c_mem(c_md, eng, c.data());
    return measure_gflops(
        [&] {
          mm.execute(strm,
                     {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
          strm.wait();
        },
        flops, min_seconds);
  } catch (const dnnl::error& e) {
    MOE_FAIL(
        "[gemm_probe] oneDNN bf16 matmul M={} N={} K={} failed: {} (status {}); this CPU "
        "or oneDNN build may lack bf16 support: probe with bf16=false",
        M, N, K, e.what(), static_cast<int>(e.status));
  }
}

double measure_model_gemm_gflops(bool use_bf16, const GemmShape& s, double min_seconds) {
  MOE_CHECK(s.M > 0 && s.N > 0 && s.K > 0, "[gemm_probe] shape M={} N={} K={} must be positive",
            s.M, s.N, s.K);
  // Stored shapes: op(A) [M,K] is stored [K,M] when transposed; likewise B.
  const int64_t lda = s.trans_a ? s.M : s.K, ldb = s.trans_b ? s.K : s.N;
  std::mt19937 gen(1234);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> a(s.M * s.K), b(s.K * s.N), c(s.M * s.N, 0.f);
  for (auto& v : a) v = dist(gen);
  for (auto& v : b) v = dist(gen);
  const double flops =
      2.0 * static_cast<double>(s.M) * static_cast<double>(s.N) * static_cast<double>(s.K);
  if (!use_bf16) {
    return measure_gflops(
        [&] {
          cpu::gemm<float>(s.trans_a, s.trans_b, s.M, s.N, s.K, 1.f, a.data(), lda, b.data(), ldb,
                           0.f, c.data(), s.N);
        },
        flops, min_seconds);
  }
  std::vector<moecore::bf16> a16(a.size()), b16(b.size());
  cpu::cast_f32_to_bf16(a16.data(), a.data(), static_cast<int64_t>(a.size()));
  cpu::cast_f32_to_bf16(b16.data(), b.data(), static_cast<int64_t>(b.size()));
  std::vector<float> ws(gemm_bf16_workspace_elems(cpu_exec(), s.M, s.N, s.K));
  return measure_gflops(
      [&] {
        cpu::gemm_bf16(s.trans_a, s.trans_b, s.M, s.N, s.K, a16.data(), lda, b16.data(), ldb, 0.f,
                       c.data(), s.N, ws.data());
      },
      flops, min_seconds);
}

}  // namespace moecore::ops
