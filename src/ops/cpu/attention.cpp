// Fast CPU causal GQA attention: blocks of query rows against the keys they may see, with the
// products on ops::gemm straight from the strided [S, B, heads, D] layout (no copies). Each
// thread holds at most two row blocks of scores [kRowBlock, S]; the backward recomputes P from
// the saved lse and owns one (b, kv head) pair per task, so dK/dV need no atomics and are
// bitwise reproducible for any thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/attention.h"
#include "ops/cpu/fast_exp.h"
#include "ops/gemm.h"

namespace moecore::ops {

namespace {

// Query rows per block. 64 keeps the GEMMs efficient (M = 64, K = D) while the wasted upper
// triangle of each diagonal block stays small against S; with S < 64 the block is all of S.
constexpr int64_t kRowBlock = 64;



int64_t row_block(const AttentionShape& s) { return std::min(s.S, kRowBlock); }

// One thread's slab: P [bk, S], dP/dS [bk, S], delta [bk]. Rounded up to 16 elements (64 bytes
// in f32) so neighbouring threads' slabs do not share a cache line.
int64_t slab_elems(const AttentionShape& s) {
  const int64_t bk = row_block(s);
  const int64_t n = 2 * bk * s.S + bk;
  return (n + 15) / 16 * 16;
}

}  // namespace

void check_attention_shape(const AttentionShape& s, const char* op) {
  MOE_CHECK(s.S >= 0 && s.B >= 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0,
            "[{}] bad shape S={} B={} Hq={} Hkv={} D={}: sizes must be >= 0 and Hq, Hkv, D > 0",
            op, s.S, s.B, s.Hq, s.Hkv, s.D);
  MOE_CHECK(s.Hq % s.Hkv == 0,
            "[{}] Hq={} not a multiple of Hkv={}: choose a number of query heads divisible by "
            "the number of key/value groups",
            op, s.Hq, s.Hkv);
}

int64_t attention_workspace_elems(const AttentionShape& s, int n_threads) {
  check_attention_shape(s, "attention");
  MOE_CHECK(n_threads >= 1,
            "[attention] n_threads={}: pass omp_get_max_threads() of the thread that will call "
            "attention_forward/backward",
            n_threads);
  return slab_elems(s) * n_threads;
}

// Workspace contract: `workspace` holds attention_workspace_elems(s, omp_get_max_threads())
// elements, omp_get_max_threads() as seen by the calling thread at the time of the call (the
// team below is exactly that size, and thread t uses slab t only).
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& s, T* workspace) {
  ScopedPhase phase(Phase::Attention);
  check_attention_shape(s, "attention");
  if (s.S == 0 || s.B == 0) return;
  MOE_CHECK(workspace != nullptr,
            "[attention] forward got no workspace: allocate attention_workspace_elems(shape, "
            "omp_get_max_threads()) elements before step 0");
  const int64_t S = s.S, B = s.B, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
  const int64_t group = Hq / Hkv;
  const int64_t ldq = B * Hq * D, ldk = B * Hkv * D;  // row strides along S
  const int64_t bk = row_block(s), n_blocks = (S + bk - 1) / bk, slab = slab_elems(s);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(D)));
  const int64_t n_bh = B * Hq;
  const int n_threads = omp_get_max_threads();

  // Forward rows are independent, so tasks are (row block, b, h): enough work for every
  // thread even at B = 1. GEMMs inside the region run single-threaded (no nested parallelism).
#pragma omp parallel num_threads(n_threads)
  {
    T* P = workspace + omp_get_thread_num() * slab;  // scores, then probabilities [m, n]
    // Late row blocks see more keys: hand them out first so the dynamic schedule ends level.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_blocks * n_bh; ++task) {
      const int64_t r = n_blocks - 1 - task / n_bh;
      const int64_t b = (task % n_bh) / Hq, h = (task % n_bh) % Hq, g = h / group;
      const int64_t i0 = r * bk, i1 = std::min(S, i0 + bk), m = i1 - i0, n = i1;
      const T* q_blk = q + (i0 * B + b) * Hq * D + h * D;
      const T* k_g = k + b * Hkv * D + g * D;
      const T* v_g = v + b * Hkv * D + g * D;
      T* out_blk = out + (i0 * B + b) * Hq * D + h * D;
      T* lse_h = lse + (b * Hq + h) * S;

      // Causal: rows i0..i1-1 see keys 0..i1-1 only, so later keys are never computed.
      gemm<T>(false, true, m, n, D, scale, q_blk, ldq, k_g, ldk, T(0), P, n);
      for (int64_t rr = 0; rr < m; ++rr) {
        const int64_t i = i0 + rr;
        T* p = P + rr * n;
        T mx = p[0];
#pragma omp simd reduction(max : mx)
        for (int64_t j = 1; j <= i; ++j) mx = std::max(mx, p[j]);
        double sum = 0.0;  // up to S terms: accumulate wide, it is nearly free
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = fast_exp(p[j] - mx);
          sum += static_cast<double>(p[j]);
        }
        const T inv = static_cast<T>(1.0 / sum);
#pragma omp simd
        for (int64_t j = 0; j <= i; ++j) p[j] *= inv;
        for (int64_t j = i + 1; j < n; ++j) p[j] = T(0);
        lse_h[i] = static_cast<T>(static_cast<double>(mx) + std::log(sum));
      }
      gemm<T>(false, false, m, D, n, T(1), P, n, v_g, ldk, T(0), out_blk, ldq);
    }
  }
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, const AttentionShape& s, T* workspace) {
  ScopedPhase phase(Phase::Attention);
  check_attention_shape(s, "attention");
  if (s.S == 0 || s.B == 0) return;
  MOE_CHECK(workspace != nullptr,
            "[attention] backward got no workspace: allocate attention_workspace_elems(shape, "
            "omp_get_max_threads()) elements before step 0");
  const int64_t S = s.S, B = s.B, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
  const int64_t group = Hq / Hkv;
  const int64_t ldq = B * Hq * D, ldk = B * Hkv * D;
  const int64_t bk = row_block(s), n_blocks = (S + bk - 1) / bk, slab = slab_elems(s);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(D)));
  const int n_threads = omp_get_max_threads();

  // One task per (b, kv head): it alone writes that dK/dV slice (summed over the query heads
  // of the group) and the dQ of those query heads, in a fixed order -> deterministic.
#pragma omp parallel num_threads(n_threads)
  {
    T* P = workspace + omp_get_thread_num() * slab;  // [m, n]
    T* dS = P + bk * S;                              // dP, then dS, [m, n]
    T* delta = dS + bk * S;                          // [m]
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * Hkv; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      const T* k_g = k + b * Hkv * D + g * D;
      const T* v_g = v + b * Hkv * D + g * D;
      T* dk_g = dk + b * Hkv * D + g * D;
      T* dv_g = dv + b * Hkv * D + g * D;
      for (int64_t j = 0; j < S; ++j) {
        std::fill(dk_g + j * ldk, dk_g + j * ldk + D, T(0));
        std::fill(dv_g + j * ldk, dv_g + j * ldk + D, T(0));
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const T* lse_h = lse + (b * Hq + h) * S;
        for (int64_t r = 0; r < n_blocks; ++r) {
          const int64_t i0 = r * bk, i1 = std::min(S, i0 + bk), m = i1 - i0, n = i1;
          const int64_t off = (i0 * B + b) * Hq * D + h * D;
          const T* q_blk = q + off;
          const T* dout_blk = dout + off;
          const T* out_blk = out + off;

          // delta_i = rowsum(dO * O) equals sum_j P_ij dP_ij but costs D per row, not S.
          for (int64_t rr = 0; rr < m; ++rr) {
            double acc = 0.0;
            for (int64_t d = 0; d < D; ++d) {
              acc += static_cast<double>(dout_blk[rr * ldq + d]) *
                     static_cast<double>(out_blk[rr * ldq + d]);
            }
            delta[rr] = static_cast<T>(acc);
          }
          // P = exp(scale * Q K^T - lse): the saved lse replaces the max/sum pass.
          gemm<T>(false, true, m, n, D, scale, q_blk, ldq, k_g, ldk, T(0), P, n);
          for (int64_t rr = 0; rr < m; ++rr) {
            const int64_t i = i0 + rr;
            T* p = P + rr * n;
            const T lse_i = lse_h[i];
#pragma omp simd
            for (int64_t j = 0; j <= i; ++j) p[j] = fast_exp(p[j] - lse_i);
            for (int64_t j = i + 1; j < n; ++j) p[j] = T(0);
          }
          // dP = dO V^T, then dS = P * (dP - delta) (zero above the diagonal since P is).
          gemm<T>(false, true, m, n, D, T(1), dout_blk, ldq, v_g, ldk, T(0), dS, n);
          for (int64_t rr = 0; rr < m; ++rr) {
            const T* p = P + rr * n;
            T* ds = dS + rr * n;
            for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - delta[rr]);
          }
          gemm<T>(true, false, n, D, m, T(1), P, n, dout_blk, ldq, T(1), dv_g, ldk);
          gemm<T>(false, false, m, D, n, scale, dS, n, k_g, ldk, T(0), dq + off, ldq);
          gemm<T>(true, false, n, D, m, scale, dS, n, q_blk, ldq, T(1), dk_g, ldk);
        }
      }
    }
  }
}

#define MOECORE_INSTANTIATE_ATTENTION(T)                                                         \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*,                     \
                                     const AttentionShape&, T*);                               \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,      \
                                      const T*, const T*, const AttentionShape&, T*);
MOECORE_INSTANTIATE_ATTENTION(float)
MOECORE_INSTANTIATE_ATTENTION(double)
#undef MOECORE_INSTANTIATE_ATTENTION

}  // namespace moecore::ops
