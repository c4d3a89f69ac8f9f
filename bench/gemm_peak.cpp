// BLAS choice bench: GFLOP/s of oneDNN sgemm, OpenBLAS and BLIS cblas_sgemm, and oneDNN's bf16
// matmul at transformer shapes, at 1 and 2 threads; plus grouped GEMM with serial groups
// (ops::grouped_gemm) vs groups in parallel with single-threaded GEMMs. bench/RESULTS.md.
//
//   bench_gemm [min_seconds_per_point = 0.5]
//
// OpenBLAS and BLIS are dlopen'ed so the build never links them (both export cblas_sgemm and
// would clash with each other); a library that is not installed is skipped with a message.
#include <dlfcn.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "ops/gemm.h"
#include "ops/gemm_probe.h"

namespace {

// CBLAS enums as ints: RowMajor = 101, NoTrans = 111. Both Debian builds use 32-bit ints.
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                            int, float, float*, int);
using SetThreads = void (*)(int);
using BlisSetThreads = void (*)(int64_t);

struct Blas {
  std::string name;
  CblasSgemm sgemm = nullptr;
  SetThreads set_threads = nullptr;           // OpenBLAS
  BlisSetThreads blis_set_threads = nullptr;  // BLIS reads its thread count from its own API/env
};

bool load(Blas& b, const char* path, const char* threads_sym) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    std::printf("# skip %s: dlopen(%s) failed: %s\n", b.name.c_str(), path, dlerror());
    return false;
  }
  b.sgemm = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
  if (b.sgemm == nullptr) {
    std::printf("# skip %s: no cblas_sgemm in %s\n", b.name.c_str(), path);
    return false;
  }
  void* t = dlsym(h, threads_sym);
  if (b.name == "BLIS")
    b.blis_set_threads = reinterpret_cast<BlisSetThreads>(t);
  else
    b.set_threads = reinterpret_cast<SetThreads>(t);
  return true;
}

struct Shape {
  int64_t M, N, K;
  const char* what;
};

std::vector<float> rand_vec(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

double time_cblas(const Blas& b, const Shape& s, double min_s) {
  auto a = rand_vec(s.M * s.K, 1), w = rand_vec(s.K * s.N, 2);
  std::vector<float> c(s.M * s.N);
  return moecore::ops::measure_gflops(
      [&] {
        b.sgemm(101, 111, 111, static_cast<int>(s.M), static_cast<int>(s.N), static_cast<int>(s.K),
                1.f, a.data(), static_cast<int>(s.K), w.data(), static_cast<int>(s.N), 0.f,
                c.data(), static_cast<int>(s.N));
      },
      2.0 * s.M * s.N * s.K, min_s);
}

// Experts' forward GEMM y_g = x_g * op(w_g) with G groups of m rows each, H -> F; w is
// [G, F, H] (trans_w) or [G, H, F].
void bench_grouped(int64_t G, int64_t m, int64_t F, int64_t H, bool trans_w, double min_s) {
  std::vector<int64_t> m_G(G, m);
  auto x = rand_vec(G * m * H, 3), w = rand_vec(G * F * H, 4);
  std::vector<float> y(G * m * F);
  double flops = 2.0 * G * m * F * H;
  auto group = [&](int64_t g) {
    dnnl_sgemm('N', trans_w ? 'T' : 'N', m, F, H, 1.f, x.data() + g * m * H, H,
               w.data() + g * F * H, trans_w ? H : F, 0.f, y.data() + g * m * F, F);
  };
  double serial = moecore::ops::measure_gflops(
      [&] {
        for (int64_t g = 0; g < G; ++g) group(g);
      },
      flops, min_s);
  // Inside an OpenMP region oneDNN runs each sgemm on the calling thread only.
  double parallel = moecore::ops::measure_gflops(
      [&] {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; ++g) group(g);
      },
      flops, min_s);
  double ours = moecore::ops::measure_gflops(
      [&] {
        moecore::ops::grouped_gemm<float>(moecore::cpu_exec(), m_G.data(), G, F, H, x.data(), w.data(),
                                          trans_w, y.data());
      },
      flops, min_s);
  std::printf("| %ld x (%ld x %ld x %ld) | %s | %d | %.1f | %.1f | %.1f |\n", static_cast<long>(G),
              static_cast<long>(m), static_cast<long>(F), static_cast<long>(H),
              trans_w ? "[G,F,H]" : "[G,H,F]", omp_get_max_threads(), serial, parallel, ours);
}

}  // namespace

int main(int argc, char** argv) {
  double min_s = argc > 1 ? std::atof(argv[1]) : 0.5;
  Blas openblas{"OpenBLAS"}, blis{"BLIS"};
  bool have_openblas = load(openblas, "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
                            "openblas_set_num_threads");
  bool have_blis = load(blis, "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4",
                        "bli_thread_set_num_threads");

  const std::vector<Shape> shapes = {
      {2048, 512, 512, "attn proj"},   {2048, 1024, 512, "ffn up"},  {2048, 512, 1024, "ffn down"},
      {256, 512, 512, "small expert"}, {2048, 8192, 512, "lm head"},
  };
  std::printf("# GFLOP/s, median over calls, >= %.2f s per point; C = A * B, row-major, no trans\n",
              min_s);
  std::printf(
      "| M x N x K | shape | threads | oneDNN sgemm | OpenBLAS sgemm | BLIS sgemm | "
      "oneDNN bf16 matmul |\n|---|---|---|---|---|---|---|\n");
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    if (openblas.set_threads) openblas.set_threads(threads);
    if (blis.blis_set_threads) blis.blis_set_threads(threads);
    for (const Shape& s : shapes) {
      double dnnl32 = moecore::ops::measure_gemm_gflops(false, s.M, s.N, s.K, min_s);
      double ob = have_openblas ? time_cblas(openblas, s, min_s) : 0.0;
      double bl = have_blis ? time_cblas(blis, s, min_s) : 0.0;
      double dnnl16 = moecore::ops::measure_gemm_gflops(true, s.M, s.N, s.K, min_s);
      std::printf("| %ldx%ldx%ld | %s | %d | %.1f | %.1f | %.1f | %.1f |\n", static_cast<long>(s.M),
                  static_cast<long>(s.N), static_cast<long>(s.K), s.what, threads, dnnl32, ob, bl,
                  dnnl16);
      std::fflush(stdout);
    }
  }

  std::printf(
      "\n# grouped GEMM (f32, oneDNN): serial groups with all threads vs parallel groups "
      "with 1-thread GEMMs vs what ops::grouped_gemm picks\n");
  std::printf(
      "| groups x (m x F x H) | w layout | threads | serial groups | parallel groups | "
      "ops::grouped_gemm |\n|---|---|---|---|---|---|\n");
  omp_set_num_threads(2);
  for (bool trans_w : {true, false}) {
    for (int64_t m : {16, 64, 256}) bench_grouped(8, m, 1024, 512, trans_w, min_s);
  }
  return 0;
}
