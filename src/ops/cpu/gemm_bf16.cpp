// bf16 GEMM: the path choice (native oneDNN bf16 or widen to f32 + sgemm, see gemm_bf16.h) and
// both paths. Native, through oneDNN: fixed shapes (projections, dense MLPs, the output head) use
// the matmul primitive: runtime dimensions send oneDNN to its reference kernel (~0.1 GFLOP/s
// measured), so primitives are built per exact shape and kept in a cache; the shapes repeat
// every step. The routed experts' row counts change every step, and building a primitive for a
// new shape costs up to tens of milliseconds (JIT), so the grouped GEMMs use oneDNN's bf16 GEMM
// function instead (dnnl_gemm_bf16bf16f32: exported by libdnnl, absent from its public header;
// the build checks for it), which has no per-shape setup and runs single-threaded inside an
// OpenMP region, so groups can run in parallel as the f32 grouped GEMM does.
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/cast.h"
#include "ops/cpu/grouped.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

#if MOECORE_HAVE_DNNL_GEMM_BF16
// Row-major like dnnl_sgemm; bfloat16_t in oneDNN's definition, the same 2-byte layout as bf16.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N,
                                               dnnl_dim_t K, float alpha, const void* A,
                                               dnnl_dim_t lda, const void* B, dnnl_dim_t ldb,
                                               float beta, float* C, dnnl_dim_t ldc);
#endif

namespace moecore::ops {

namespace {

using dnnl::memory;
using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;

// A primitive with its argument memories, built once per shape: each call only sets the data
// handles and executes through the C API with a fixed argument array, so a cached shape runs
// without allocating (the C++ execute builds an argument map and a vector per call, which a
// sync-audited step reports).
struct Matmul {
  dnnl::matmul prim;
  memory a, b, c;
};

class MatmulCache {
 public:
  static constexpr size_t kMaxEntries = 8192;

  MatmulCache() : eng_(dnnl::engine::kind::cpu, 0), stream_(eng_) {}

  void run(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda,
           const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    const Key key{ta, tb, M, N, K, lda, ldb, ldc, beta != 0.f};
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      if (cache_.size() >= kMaxEntries) cache_.clear();
      it = cache_.emplace(key, build(ta, tb, M, N, K, lda, ldb, ldc, beta != 0.f)).first;
    }
    Matmul& mm = it->second;
    mm.a.set_data_handle(const_cast<bf16*>(A));
    mm.b.set_data_handle(const_cast<bf16*>(B));
    mm.c.set_data_handle(C);
    const dnnl_exec_arg_t args[3] = {
        {DNNL_ARG_SRC, mm.a.get()}, {DNNL_ARG_WEIGHTS, mm.b.get()}, {DNNL_ARG_DST, mm.c.get()}};
    const dnnl_status_t st = dnnl_primitive_execute(mm.prim.get(), stream_.get(), 3, args);
    MOE_CHECK(st == dnnl_success, "[gemm_bf16] oneDNN bf16 matmul M={} N={} K={} failed: status {}",
              M, N, K, static_cast<int>(st));
    stream_.wait();
  }

 private:
  Matmul build(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
               int64_t ldc, bool accumulate) {
    using dt = memory::data_type;
    // Transposes are strides: op(A) [M,K] with A stored [K,M] has strides {1, lda}.
    memory::desc a({M, K}, dt::bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
    memory::desc b({K, N}, dt::bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
    memory::desc c({M, N}, dt::f32, memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, eng_);
      return Matmul{dnnl::matmul(pd), memory(a, eng_, DNNL_MEMORY_NONE),
                    memory(b, eng_, DNNL_MEMORY_NONE), memory(c, eng_, DNNL_MEMORY_NONE)};
    } catch (const dnnl::error& e) {
      MOE_FAIL(
          "[gemm_bf16] oneDNN cannot build a bf16 matmul M={} N={} K={}: {} (this CPU may "
          "lack bf16 support: train without --bf16)",
          M, N, K, e.what());
    }
  }

  dnnl::engine eng_;
  dnnl::stream stream_;
  std::map<Key, Matmul> cache_;
};

MatmulCache& cache() {
  // One per thread: primitives and streams are not shared across concurrent callers.
  thread_local MatmulCache c;
  return c;
}

struct PathChoice {
  Bf16GemmPath path;
  std::string why;
};

// oneDNN's effective ISA already honours DNNL_MAX_CPU_ISA. The ISA values are nested bit masks
// (avx512_core_bf16 = avx512_core_vnni | one more bit), but not ordered: avx2_vnni > bf16
// numerically, so test the bits, not `>=`.
bool isa_has(dnnl_cpu_isa_t bits) {
  const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  return (isa & static_cast<unsigned>(bits)) == static_cast<unsigned>(bits);
}

PathChoice detect_path() {
  if (const char* env = std::getenv("MOECORE_BF16_GEMM"); env != nullptr && *env != '\0') {
    const std::string v(env);
    MOE_CHECK(v == "native" || v == "widen",
              "[gemm_bf16] MOECORE_BF16_GEMM={} must be 'native' or 'widen' (or unset: chosen "
              "from the CPU)",
              v);
    MOE_CHECK(v == "widen" || isa_has(dnnl_cpu_isa_avx512_core),
              "[gemm_bf16] MOECORE_BF16_GEMM=native, but oneDNN runs below AVX-512 here and has "
              "no bf16 matmul: use MOECORE_BF16_GEMM=widen or leave it unset");
    return {v == "native" ? Bf16GemmPath::Native : Bf16GemmPath::Widen,
            "forced by MOECORE_BF16_GEMM=" + v};
  }
  if (isa_has(dnnl_cpu_isa_avx512_core_bf16)) return {Bf16GemmPath::Native, "avx512_core_bf16"};
  if (const char* cap = std::getenv("DNNL_MAX_CPU_ISA"); cap != nullptr && *cap != '\0') {
    return {Bf16GemmPath::Widen, std::string("no AVX512-BF16 under DNNL_MAX_CPU_ISA=") + cap};
  }
  return {Bf16GemmPath::Widen, "CPU has no AVX512-BF16"};
}

std::mutex path_mutex;
PathChoice* path_choice = nullptr;

PathChoice& choice() {
  std::lock_guard<std::mutex> lock(path_mutex);
  if (path_choice == nullptr) path_choice = new PathChoice(detect_path());
  return *path_choice;
}

// Widens a rows x cols block of a row-major bf16 matrix (row stride ld) into a dense f32 one.
void widen(float* y, const bf16* x, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) return cpu::cast_bf16_to_f32(y, x, rows * cols);
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 16))
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* src = x16 + i * ld;
    float* dst = y + i * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) dst[j] = std::bit_cast<float>(uint32_t{src[j]} << 16);
  }
}

void check_ws(const float* ws32, const char* who) {
  MOE_CHECK(ws32 != nullptr,
            "[{}] the widen bf16 path needs f32 workspace (ws32 is null): plan it with the "
            "*_workspace_elems functions of ops/gemm_bf16.h after choosing the path",
            who);
}
// The native path's bf16 copies of the f32 operands (x16, dy16).
void check_ws16(const bf16* ws16, const char* what, const char* who) {
  MOE_CHECK(ws16 != nullptr,
            "[{}] the native bf16 path needs the bf16 workspace {} (it is null): plan it beside "
            "the operand it holds",
            who, what);
}

}  // namespace

Bf16GemmPath bf16_gemm_path() {
  return choice().path;
}

Bf16GemmPath bf16_gemm_path(const Exec& ex) {
  return ex.on_cpu() ? bf16_gemm_path() : Bf16GemmPath::Native;
}

bool bf16_native_available() {
  return isa_has(dnnl_cpu_isa_avx512_core);
}

void set_bf16_gemm_path(Bf16GemmPath path) {
  MOE_CHECK(path == Bf16GemmPath::Widen || bf16_native_available(),
            "[gemm_bf16] the native bf16 path needs oneDNN at AVX-512 or above; it runs below "
            "that here (no bf16 matmul): use the widen path");
  PathChoice& c = choice();
  std::lock_guard<std::mutex> lock(path_mutex);
  c.path = path;
  c.why = "set by the program";
}

const char* bf16_gemm_path_name(Bf16GemmPath path) {
  return path == Bf16GemmPath::Native ? "native" : "widen";
}

std::string bf16_gemm_path_line() {
  const PathChoice& c = choice();
  return c.path == Bf16GemmPath::Native ? "[gemm] bf16 GEMMs: oneDNN native bf16 (" + c.why + ")"
                                        : "[gemm] bf16 GEMMs: widen to f32 + sgemm (" + c.why + ")";
}

int64_t gemm_bf16_workspace_elems(const Exec& ex, int64_t M, int64_t N, int64_t K) {
  return bf16_gemm_path(ex) == Bf16GemmPath::Widen ? M * K + K * N : 0;
}

int64_t linear_bf16_workspace_elems(const Exec& ex, int64_t M, int64_t N, int64_t K) {
  if (bf16_gemm_path(ex) != Bf16GemmPath::Widen) return 0;
  return std::max(M * K + N * K, M * N + std::max(N * K, M * K));
}

int64_t grouped_gemm_bf16_workspace_elems(const Exec& ex, int64_t max_rows, int64_t N, int64_t K,
                                          int threads) {
  if (bf16_gemm_path(ex) != Bf16GemmPath::Widen) return 0;
  return max_rows * K + std::max(threads, 1) * N * K;
}

int64_t grouped_gemm_wgrad_bf16_workspace_elems(const Exec& ex, int64_t max_rows, int64_t N,
                                                int64_t K) {
  return bf16_gemm_path(ex) == Bf16GemmPath::Widen ? max_rows * (N + K) : 0;
}

namespace cpu {

void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
               int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc,
               float* ws32, const float* b32) {
  ScopedPhase phase(Phase::Gemm);
  MOE_CHECK(M >= 0 && N >= 0 && K >= 0, "[gemm_bf16] negative shape M={} N={} K={}", M, N, K);
  MOE_CHECK(beta == 0.f || beta == 1.f, "[gemm_bf16] beta={} must be 0 or 1", beta);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (beta == 0.f) {
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = 0.f;
      }
    }
    return;
  }
  if (bf16_gemm_path() == Bf16GemmPath::Widen) {
    check_ws(ws32, "gemm_bf16");
    // op(A) [M,K] stored as [K,M] when transposed; widened densely (row stride = columns).
    const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    float* a32 = ws32;
    widen(a32, A, a_rows, a_cols, lda);
    if (b32 != nullptr) {
      return gemm<float>(trans_a, trans_b, M, N, K, 1.f, a32, a_cols, b32, ldb, beta, C, ldc);
    }
    float* bw = ws32 + M * K;
    widen(bw, B, b_rows, b_cols, ldb);
    return gemm<float>(trans_a, trans_b, M, N, K, 1.f, a32, a_cols, bw, b_cols, beta, C, ldc);
  }
  cache().run(trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

// Widen: the f32 activations are rounded to bf16 values straight into f32 workspace (one pass,
// no bf16 copy); the bf16 weight is widened. Layout of ws32: forward [x | w]; backward
// [dy | w], then [dy | x] (w is dead once dx is done).
void linear_forward_bf16(float* y_MN, const float* x_MK, const bf16* w_NK, int64_t M, int64_t N,
                         int64_t K, bf16* x16, float* ws32, const float* w32, bool x_rounded) {
  if (bf16_gemm_path() == Bf16GemmPath::Widen && M > 0 && N > 0 && K > 0) {
    ScopedPhase phase(Phase::Gemm);
    if (!x_rounded || w32 == nullptr) check_ws(ws32, "linear_forward_bf16");
    const float* x32 = x_MK;
    if (!x_rounded) {
      round_f32_to_bf16(ws32, x_MK, M * K);
      x32 = ws32;
    }
    if (w32 == nullptr) {
      float* wide = ws32 + M * K;
      cast_bf16_to_f32(wide, w_NK, N * K);
      w32 = wide;
    }
    return linear_forward<float>(y_MN, x32, w32, M, N, K);
  }
  if (M * K > 0) check_ws16(x16, "x16", "linear_forward_bf16");
  cast_f32_to_bf16(x16, x_MK, M * K);
  gemm_bf16(false, true, M, N, K, x16, K, w_NK, K, 0.f, y_MN, N, ws32);
}

void linear_backward_bf16(float* dx_MK, float* dw_NK, const float* dy_MN, const float* x_MK,
                          const bf16* w_NK, int64_t M, int64_t N, int64_t K, bf16* dy16, bf16* x16,
                          float* ws32, const float* w32, bool x_rounded) {
  if (bf16_gemm_path() == Bf16GemmPath::Widen && M > 0 && N > 0 && K > 0) {
    check_ws(ws32, "linear_backward_bf16");
    ScopedPhase phase(Phase::Gemm);
    float* dy32 = ws32;
    float* rest = ws32 + M * N;
    round_f32_to_bf16(dy32, dy_MN, M * N);
    if (dx_MK != nullptr) {
      if (w32 == nullptr) {
        cast_bf16_to_f32(rest, w_NK, N * K);
        w32 = rest;
      }
      gemm<float>(false, false, M, K, N, 1.f, dy32, N, w32, K, 0.f, dx_MK, K);
    }
    const float* x32 = x_MK;
    if (!x_rounded) {
      round_f32_to_bf16(rest, x_MK, M * K);
      x32 = rest;
    }
    return gemm<float>(true, false, N, K, M, 1.f, dy32, N, x32, K, 1.f, dw_NK, K);
  }
  if (M * N > 0) check_ws16(dy16, "dy16", "linear_backward_bf16");
  if (M * K > 0) check_ws16(x16, "x16", "linear_backward_bf16");
  cast_f32_to_bf16(dy16, dy_MN, M * N);
  if (dx_MK != nullptr) gemm_bf16(false, false, M, K, N, dy16, N, w_NK, K, 0.f, dx_MK, K, ws32);
  cast_f32_to_bf16(x16, x_MK, M * K);
  gemm_bf16(true, false, N, K, M, dy16, N, x16, K, 1.f, dw_NK, K, ws32);
}

namespace {

// One GEMM of a grouped call (shapes already checked, M, N, K > 0).
void group_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#if MOECORE_HAVE_DNNL_GEMM_BF16
  const dnnl_status_t st = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K,
                                                 1.f, A, lda, B, ldb, beta, C, ldc);
  MOE_CHECK(st == dnnl_success,
            "[gemm_bf16] dnnl_gemm_bf16bf16f32 failed with status {} (M={} N={} K={}): this CPU "
            "may lack bf16 support: train without --bf16",
            static_cast<int>(st), M, N, K);
#else
  cache().run(trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
#endif
}

// Groups in parallel only where each group's GEMM then runs on its own thread.
bool bf16_groups_in_parallel(const int64_t* m_G, int64_t G) {
  return MOECORE_HAVE_DNNL_GEMM_BF16 && detail::groups_in_parallel(m_G, G);
}

}  // namespace

void grouped_gemm_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* x16,
                       const bf16* w, bool trans_w, float* y, float* ws32, const float* w32) {
  ScopedPhase phase(Phase::Gemm);
  detail::check_group_sizes("grouped_gemm_bf16", m_G, G, N, K);
  if (N == 0) return;
  if (K == 0) {  // empty products: y = 0
    int64_t rows = 0;
    for (int64_t g = 0; g < G; ++g) rows += m_G[g];
    std::fill(y, y + rows * N, 0.f);
    return;
  }
  if (bf16_gemm_path() == Bf16GemmPath::Widen) {
    // All rows widened at once; each group's weight into its thread's slot just before its
    // GEMM (N*K f32: 2 MiB for a bench-small fc1, so it is still in L2 when sgemm reads it).
    int64_t rows = 0;
    for (int64_t g = 0; g < G; ++g) rows += m_G[g];
    if (rows == 0) return;
    check_ws(ws32, "grouped_gemm_bf16");
    float* x32 = ws32;
    float* slots = ws32 + rows * K;
    cast_bf16_to_f32(x32, x16, rows * K);
    const bool parallel = detail::groups_in_parallel(m_G, G);
    const int64_t ld_w = trans_w ? K : N;
    detail::for_each_group(m_G, G, parallel, [&](int64_t g, int64_t row0) {
      const float* wg = w32 != nullptr ? w32 + g * N * K : nullptr;
      if (wg == nullptr) {
        float* slot = slots + (omp_in_parallel() ? omp_get_thread_num() : 0) * N * K;
        cast_bf16_to_f32(slot, w + g * N * K, N * K);
        wg = slot;
      }
      gemm<float>(false, trans_w, m_G[g], N, K, 1.f, x32 + row0 * K, K, wg, ld_w, 0.f, y + row0 * N,
                  N);
    });
    return;
  }
  detail::for_each_group(m_G, G, bf16_groups_in_parallel(m_G, G), [&](int64_t g, int64_t row0) {
    group_gemm(false, trans_w, m_G[g], N, K, x16 + row0 * K, K, w + g * N * K, trans_w ? K : N, 0.f,
               y + row0 * N, N);
  });
}

void grouped_gemm_wgrad_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* dy16,
                             const bf16* x16, float* dw, float* ws32) {
  ScopedPhase phase(Phase::Gemm);
  detail::check_group_sizes("grouped_gemm_wgrad_bf16", m_G, G, N, K);
  if (N == 0 || K == 0) return;
  if (bf16_gemm_path() == Bf16GemmPath::Widen) {
    int64_t rows = 0;
    for (int64_t g = 0; g < G; ++g) rows += m_G[g];
    if (rows == 0) return;  // every expert empty: dw += 0
    check_ws(ws32, "grouped_gemm_wgrad_bf16");
    float* dy32 = ws32;
    float* x32 = ws32 + rows * N;
    cast_bf16_to_f32(dy32, dy16, rows * N);
    cast_bf16_to_f32(x32, x16, rows * K);
    return grouped_gemm_wgrad<float>(m_G, G, N, K, dy32, x32, dw);
  }
  // An expert that got no tokens is skipped: its dw_g += 0.
  detail::for_each_group(m_G, G, bf16_groups_in_parallel(m_G, G), [&](int64_t g, int64_t row0) {
    group_gemm(true, false, N, K, m_G[g], dy16 + row0 * N, N, x16 + row0 * K, K, 1.f,
               dw + g * N * K, K);
  });
}

// The bf16-output forms' epilogue: y16 = bf16(h32 + b_g) per row of group g, grouped_bias_forward's
// f32 add and cast_f32_to_bf16's rounding in one pass (h32 is left as it was).
void grouped_bias_round_bf16(bf16* y16, const float* h32, const float* bias_GN, const int64_t* m_G,
                             int64_t G, int64_t N) {
  detail::check_group_sizes("grouped_bias_round_bf16", m_G, G, N, 0);
  int64_t rows = 0;
  for (int64_t g = 0; g < G; ++g) rows += m_G[g];
  if (bias_GN == nullptr) return cast_f32_to_bf16(y16, h32, rows * N);
  uint16_t* y = reinterpret_cast<uint16_t*>(y16);
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    const float* b = bias_GN + g * N;
#pragma omp parallel for schedule(static) if (m_G[g] * N >= (int64_t{1} << 16))
    for (int64_t i = row0; i < row0 + m_G[g]; ++i) {
      const float* h = h32 + i * N;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) y[i * N + j] = f32_to_bf16_bits(h[j] + b[j]);
    }
    row0 += m_G[g];
  }
}

}  // namespace cpu
}  // namespace moecore::ops
