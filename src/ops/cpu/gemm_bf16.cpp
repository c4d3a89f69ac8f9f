// bf16 GEMM through oneDNN. Fixed shapes (projections, dense MLPs, the output head) use the
// matmul primitive: runtime dimensions send oneDNN to its reference kernel (~0.1 GFLOP/s
// measured), so primitives are built per exact shape and kept in a cache; the shapes repeat
// every step. The routed experts' row counts change every step, and building a primitive for a
// new shape costs up to tens of milliseconds (JIT), so the grouped GEMMs use oneDNN's bf16 GEMM
// function instead (dnnl_gemm_bf16bf16f32: exported by libdnnl, absent from its public header;
// the build checks for it), which has no per-shape setup and runs single-threaded inside an
// OpenMP region, so groups can run in parallel as the f32 grouped GEMM does.
#include <omp.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/cast.h"
#include "ops/cpu/grouped.h"
#include "ops/gemm_bf16.h"

#if MOECORE_HAVE_DNNL_GEMM_BF16
// Row-major like dnnl_sgemm; bfloat16_t in oneDNN's definition, the same 2-byte layout as bf16.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
                                               dnnl_dim_t N, dnnl_dim_t K, float alpha,
                                               const void* A, dnnl_dim_t lda, const void* B,
                                               dnnl_dim_t ldb, float beta, float* C,
                                               dnnl_dim_t ldc);
#endif

namespace moecore::ops {

namespace {

using dnnl::memory;
using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;

struct Matmul {
  dnnl::matmul prim;
  memory::desc a, b, c;
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
    memory am(mm.a, eng_, const_cast<bf16*>(A));
    memory bm(mm.b, eng_, const_cast<bf16*>(B));
    memory cm(mm.c, eng_, C);
    mm.prim.execute(stream_, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
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
      return Matmul{dnnl::matmul(pd), a, b, c};
    } catch (const dnnl::error& e) {
      MOE_FAIL("[gemm_bf16] oneDNN cannot build a bf16 matmul M={} N={} K={}: {} (this CPU may "
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

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
               int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
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
  cache().run(trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void linear_forward_bf16(float* y_MN, const float* x_MK, const bf16* w_NK, int64_t M, int64_t N,
                         int64_t K, bf16* x16) {
  cast_f32_to_bf16(x16, x_MK, M * K);
  gemm_bf16(false, true, M, N, K, x16, K, w_NK, K, 0.f, y_MN, N);
}

void linear_backward_bf16(float* dx_MK, float* dw_NK, const float* dy_MN, const float* x_MK,
                          const bf16* w_NK, int64_t M, int64_t N, int64_t K, bf16* dy16,
                          bf16* x16) {
  cast_f32_to_bf16(dy16, dy_MN, M * N);
  if (dx_MK != nullptr) gemm_bf16(false, false, M, K, N, dy16, N, w_NK, K, 0.f, dx_MK, K);
  cast_f32_to_bf16(x16, x_MK, M * K);
  gemm_bf16(true, false, N, K, M, dy16, N, x16, K, 1.f, dw_NK, K);
}

namespace {

// One GEMM of a grouped call (shapes already checked, M, N, K > 0).
void group_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#if MOECORE_HAVE_DNNL_GEMM_BF16
  const dnnl_status_t st = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N,
                                                 K, 1.f, A, lda, B, ldb, beta, C, ldc);
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
                       const bf16* w, bool trans_w, float* y) {
  ScopedPhase phase(Phase::Gemm);
  detail::check_group_sizes("grouped_gemm_bf16", m_G, G, N, K);
  if (N == 0) return;
  if (K == 0) {  // empty products: y = 0
    int64_t rows = 0;
    for (int64_t g = 0; g < G; ++g) rows += m_G[g];
    std::fill(y, y + rows * N, 0.f);
    return;
  }
  detail::for_each_group(m_G, G, bf16_groups_in_parallel(m_G, G), [&](int64_t g, int64_t row0) {
    group_gemm(false, trans_w, m_G[g], N, K, x16 + row0 * K, K, w + g * N * K, trans_w ? K : N,
               0.f, y + row0 * N, N);
  });
}

void grouped_gemm_wgrad_bf16(const int64_t* m_G, int64_t G, int64_t N, int64_t K, const bf16* dy16,
                             const bf16* x16, float* dw) {
  ScopedPhase phase(Phase::Gemm);
  detail::check_group_sizes("grouped_gemm_wgrad_bf16", m_G, G, N, K);
  if (N == 0 || K == 0) return;
  // An expert that got no tokens is skipped: its dw_g += 0.
  detail::for_each_group(m_G, G, bf16_groups_in_parallel(m_G, G), [&](int64_t g, int64_t row0) {
    group_gemm(true, false, N, K, m_G[g], dy16 + row0 * N, N, x16 + row0 * K, K, 1.f,
               dw + g * N * K, K);
  });
}

}  // namespace moecore::ops
