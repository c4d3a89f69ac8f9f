// Dispatch permutation reference: the map is built by scanning experts, then tokens, then slots
// (O(E*T*K), obviously expert-major and token-ascending); the gathers are plain loops with f64
// accumulation. The oracle for permute.cpp.
#include <algorithm>
#include <limits>
#include <vector>

#include "core/check.h"
#include "ops/cpu/store_bf16.h"
#include "ops/permute.h"

namespace moecore::ops {

int64_t build_permutation_ref(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                              int32_t* token_rows_TK, const int32_t* idx_TK, int64_t n_tok,
                              int64_t K, int64_t E) {
  MOE_CHECK(E >= 1, "[permute] num_experts={} must be >= 1", E);
  MOE_CHECK(n_tok * K <= std::numeric_limits<int32_t>::max(),
            "[permute] T*K={}*{} rows overflow the int32 row maps: use smaller micro-batches",
            n_tok, K);
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      int32_t e = idx_TK[t * K + k];
      MOE_CHECK(e < E,
                "[permute] expert id {} at token {} slot {} >= num_experts {}: the router output "
                "and --moe-num-experts disagree",
                e, t, k, E);
      token_rows_TK[t * K + k] = -1;
    }
  }
  int64_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    counts_E[e] = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        if (idx_TK[t * K + k] != e) continue;
        row_token_N[r] = int32_t(t);
        row_slot_N[r] = int32_t(k);
        token_rows_TK[t * K + k] = int32_t(r);
        ++counts_E[e];
        ++r;
      }
    }
  }
  const int64_t n_kept = r;
  for (; r < n_tok * K; ++r) row_token_N[r] = row_slot_N[r] = -1;  // the dropped slots' rows
  return n_kept;
}

// Rebuilt from the packed map: expert e's rows are the packed rows [start_e, start_e + count_e)
// in order, then pad rows up to cap.
int64_t pad_permutation_ref(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                            int32_t* token_rows_TK, int64_t n_real, int64_t n_tok, int64_t K,
                            int64_t E, int64_t cap) {
  std::vector<int32_t> tok(row_token_N, row_token_N + n_real), slot(row_slot_N, row_slot_N + n_real);
  int64_t start = 0, pad = 0;
  for (int64_t e = 0; e < E; ++e) {
    MOE_CHECK(counts_E[e] <= cap, "[dispatcher] expert {} has {} rows > capacity {}", e,
              counts_E[e], cap);
    for (int64_t j = 0; j < cap; ++j) {
      const bool real = j < counts_E[e];
      row_token_N[e * cap + j] = real ? tok[start + j] : -1;
      row_slot_N[e * cap + j] = real ? slot[start + j] : -1;
    }
    start += counts_E[e];
    pad += cap - counts_E[e];
    counts_E[e] = cap;
  }
  for (int64_t i = 0; i < n_tok * K; ++i) token_rows_TK[i] = -1;
  for (int64_t r = 0; r < E * cap; ++r) {
    if (row_token_N[r] >= 0) token_rows_TK[row_token_N[r] * K + row_slot_N[r]] = int32_t(r);
  }
  return pad;
}

template <typename T>
void gather_row_probs_ref(T* p_N, const T* probs_TK, const int32_t* row_token_N,
                          const int32_t* row_slot_N, int64_t N, int64_t K) {
  for (int64_t r = 0; r < N; ++r) {
    p_N[r] = row_token_N[r] < 0 ? T(0) : probs_TK[row_token_N[r] * K + row_slot_N[r]];
  }
}

template <typename T>
void scatter_row_probs_ref(T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK,
                           int64_t TK) {
  for (int64_t i = 0; i < TK; ++i) dprobs_TK[i] = token_rows_TK[i] < 0 ? T(0) : dp_N[token_rows_TK[i]];
}

template <typename T>
void permute_rows_ref(T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t N, int64_t H) {
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      y_NH[r * H + h] = row_token_N[r] < 0 ? T{} : x_TH[int64_t(row_token_N[r]) * H + h];
    }
  }
}

// y[t] = the sum of token t's K rows in k order, accumulated in Acc from the rows' values (bf16
// widened exactly to f32).
template <typename Acc, typename Y, typename X>
void sum_token_rows(Y* y_TH, const X* x_NH, const int32_t* token_rows_TK, int64_t n_tok, int64_t K,
                    int64_t H) {
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      Acc acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = token_rows_TK[t * K + k];
        if (r >= 0) acc += Acc(cpu::widen(x_NH[r * H + h]));
      }
      y_TH[t * H + h] = Y(acc);
    }
  }
}

template <typename T>
void unpermute_rows_ref(T* y_TH, const T* x_NH, const int32_t* token_rows_TK, int64_t n_tok,
                        int64_t K, int64_t H) {
  sum_token_rows<double>(y_TH, x_NH, token_rows_TK, n_tok, K, H);
}

// The bf16 rows' sum in f32 (the kernels' order and precision).
void unpermute_rows_ref(float* y_TH, const bf16* x_NH, const int32_t* token_rows_TK, int64_t n_tok,
                        int64_t K, int64_t H) {
  sum_token_rows<float>(y_TH, x_NH, token_rows_TK, n_tok, K, H);
}

// From the definition: for each local expert, for each source rank, that rank's kept slots of
// the expert in (token, slot) order, then the block's pad rows.
int64_t build_group_permutation_ref(int64_t* rows_L, int32_t* row_token_N, int32_t* row_slot_N,
                                    int32_t* group_rows_GK, int64_t* pads, const GroupRouting& g) {
  const int32_t* idx = raw_ptr(g.idx_GK);
  const int64_t* tok_off = raw_ptr(g.tok_off_R);
  const int64_t* cap_R = raw_ptr(g.cap_R);
  const int64_t G = tok_off[g.R];
  // Rows beyond the plan: rows_L alone, and N.
  int64_t need = 0;
  for (int64_t l = 0; l < g.L; ++l) {
    const int64_t start = need;
    for (int64_t r = 0; r < g.R; ++r) {
      int64_t c = 0;
      for (int64_t i = tok_off[r] * g.K; i < tok_off[r + 1] * g.K; ++i) c += idx[i] == g.first + l;
      MOE_CHECK(cap_R[r] <= 0 || c <= cap_R[r], "[dispatcher] expert {} over capacity",
                g.first + l);
      need += std::max(c, cap_R[r]);
    }
    rows_L[l] = need - start;
  }
  if (need > g.max_rows) return need;
  for (int64_t i = 0; i < G * g.K; ++i) group_rows_GK[i] = -1;
  int64_t N = 0;
  *pads = 0;
  for (int64_t l = 0; l < g.L; ++l) {  // rows_L and the capacities: the counting pass above
    for (int64_t r = 0; r < g.R; ++r) {
      int64_t c = 0;
      for (int64_t t = tok_off[r]; t < tok_off[r + 1]; ++t) {
        for (int64_t k = 0; k < g.K; ++k) {
          if (idx[t * g.K + k] != g.first + l) continue;
          row_token_N[N] = static_cast<int32_t>(t);
          row_slot_N[N] = static_cast<int32_t>(k);
          group_rows_GK[t * g.K + k] = static_cast<int32_t>(N);
          ++N, ++c;
        }
      }
      for (; cap_R[r] > 0 && c < cap_R[r]; ++c) {
        row_token_N[N] = row_slot_N[N] = -1;
        ++N;
        if (r == g.me) ++*pads;
      }
    }
  }
  return N;
}

template <typename T>
void copy_row_chunks_ref(T* dst_NW, const T* src_NW, const int64_t* dst_off,
                         const int64_t* src_off, const int64_t* rows, int64_t n_chunks, int64_t W) {
  for (int64_t c = 0; c < n_chunks; ++c) {
    for (int64_t i = 0; i < rows[c] * W; ++i) dst_NW[dst_off[c] * W + i] = src_NW[src_off[c] * W + i];
  }
}

template void copy_row_chunks_ref<float>(float*, const float*, const int64_t*, const int64_t*,
                                         const int64_t*, int64_t, int64_t);
template void copy_row_chunks_ref<double>(double*, const double*, const int64_t*, const int64_t*,
                                          const int64_t*, int64_t, int64_t);
template void copy_row_chunks_ref<bf16>(bf16*, const bf16*, const int64_t*, const int64_t*,
                                        const int64_t*, int64_t, int64_t);
template void gather_row_probs_ref<float>(float*, const float*, const int32_t*, const int32_t*,
                                          int64_t, int64_t);
template void gather_row_probs_ref<double>(double*, const double*, const int32_t*, const int32_t*,
                                           int64_t, int64_t);
template void scatter_row_probs_ref<float>(float*, const float*, const int32_t*, int64_t);
template void scatter_row_probs_ref<double>(double*, const double*, const int32_t*, int64_t);
template void permute_rows_ref<float>(float*, const float*, const int32_t*, int64_t, int64_t);
template void permute_rows_ref<double>(double*, const double*, const int32_t*, int64_t, int64_t);
template void permute_rows_ref<bf16>(bf16*, const bf16*, const int32_t*, int64_t, int64_t);
template void unpermute_rows_ref<float>(float*, const float*, const int32_t*, int64_t, int64_t,
                                        int64_t);
template void unpermute_rows_ref<double>(double*, const double*, const int32_t*, int64_t, int64_t,
                                         int64_t);

}  // namespace moecore::ops
