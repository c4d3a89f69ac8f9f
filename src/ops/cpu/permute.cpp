// Dispatch permutation fast path: the map is a stable counting sort in O(T*K + E) that uses
// counts_E itself as the scatter cursor (no scratch memory); the row gathers run OpenMP over
// destination rows, so every output element has one writer and a fixed summation order.
#include <algorithm>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "ops/cast.h"
#include "ops/permute.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

int64_t build_permutation(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                          int32_t* token_rows_TK, const int32_t* idx_TK, int64_t n_tok, int64_t K,
                          int64_t E) {
  MOE_CHECK(E >= 1, "[permute] num_experts={} must be >= 1", E);
  MOE_CHECK(n_tok * K <= std::numeric_limits<int32_t>::max(),
            "[permute] T*K={}*{} rows overflow the int32 row maps: use smaller micro-batches",
            n_tok, K);
  const int64_t TK = n_tok * K;
  for (int64_t e = 0; e < E; ++e) counts_E[e] = 0;
  for (int64_t i = 0; i < TK; ++i) {
    const int32_t e = idx_TK[i];
    MOE_CHECK(e < E,
              "[permute] expert id {} at token {} slot {} >= num_experts {}: the router output "
              "and --moe-num-experts disagree",
              e, i / K, i % K, E);
    if (e >= 0) ++counts_E[e];
  }
  // counts -> start offsets.
  int64_t N = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts_E[e];
    counts_E[e] = N;
    N += c;
  }
  // Scatter in (t, k) order: stable, hence token-ascending within an expert. Afterwards
  // counts_E[e] holds the end offset of expert e.
  for (int64_t i = 0; i < TK; ++i) {
    const int32_t e = idx_TK[i];
    if (e < 0) {
      token_rows_TK[i] = -1;
      continue;
    }
    const int64_t r = counts_E[e]++;
    row_token_N[r] = int32_t(i / K);
    row_slot_N[r] = int32_t(i % K);
    token_rows_TK[i] = int32_t(r);
  }
  // End offsets -> counts (high to low so counts_E[e - 1] is still an end offset).
  for (int64_t e = E - 1; e > 0; --e) counts_E[e] -= counts_E[e - 1];
  // The dropped slots' rows: pad rows up to T*K.
  for (int64_t r = N; r < TK; ++r) row_token_N[r] = row_slot_N[r] = -1;
  return N;
}

int64_t pad_permutation(int64_t* counts_E, int32_t* row_token_N, int32_t* row_slot_N,
                        int32_t* token_rows_TK, int64_t n_real, int64_t n_tok, int64_t K, int64_t E,
                        int64_t cap) {
  // Last expert first: blocks only move up (e * cap >= their packed offset), so memmove never
  // overwrites a block not yet moved.
  int64_t end = n_real, pad = 0;
  for (int64_t e = E - 1; e >= 0; --e) {
    const int64_t cnt = counts_E[e];
    MOE_CHECK(cnt <= cap,
              "[dispatcher] expert {} has {} rows > capacity {}: the router must drop to "
              "capacity before padding",
              e, cnt, cap);
    const int64_t from = end - cnt;
    end = from;
    std::memmove(row_token_N + e * cap, row_token_N + from, sizeof(int32_t) * cnt);
    std::memmove(row_slot_N + e * cap, row_slot_N + from, sizeof(int32_t) * cnt);
    for (int64_t r = e * cap + cnt; r < (e + 1) * cap; ++r) row_token_N[r] = row_slot_N[r] = -1;
    pad += cap - cnt;
    counts_E[e] = cap;
  }
  for (int64_t r = 0; r < E * cap; ++r) {
    if (row_token_N[r] >= 0)
      token_rows_TK[int64_t(row_token_N[r]) * K + row_slot_N[r]] = int32_t(r);
  }
  (void)n_tok;  // dropped slots keep token_rows -1 from build_permutation (the ref resets them)
  return pad;
}

// A counting sort over (local expert, source rank); within a chunk, token order.
int64_t build_group_permutation(int64_t* rows_L, int32_t* row_token_N, int32_t* row_slot_N,
                                int32_t* group_rows_GK, int64_t* chunk_LR, int64_t* pads,
                                const GroupRouting& g) {
  const int64_t* tok_off = raw_ptr(g.tok_off_R);
  const int64_t* cap_R = raw_ptr(g.cap_R);
  const int64_t R = g.R, L = g.L, K = g.K;
  const int32_t* idx = raw_ptr(g.idx_GK);
  std::fill(chunk_LR, chunk_LR + L * R, 0);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = tok_off[r] * K; i < tok_off[r + 1] * K; ++i) {
      const int64_t l = idx[i] - g.first;
      if (idx[i] >= 0 && l >= 0 && l < L) ++chunk_LR[l * R + r];
    }
  }
  int64_t N = 0, pad = 0;
  for (int64_t l = 0; l < L; ++l) {
    int64_t rows = 0;
    for (int64_t r = 0; r < R; ++r) {
      int64_t& c = chunk_LR[l * R + r];
      const int64_t cap = cap_R[r];
      MOE_CHECK(cap <= 0 || c <= cap,
                "[dispatcher] expert {} has {} rows from EP rank {} > capacity {}: the router must "
                "drop to capacity before padding",
                g.first + l, c, r, cap);
      const int64_t block = cap > 0 ? cap : c;
      if (r == g.me) pad += block - c;
      const int64_t start = N;
      c = start;  // from here on: the chunk's first row
      N += block;
      rows += block;
    }
    rows_L[l] = rows;
  }
  if (N > g.max_rows) return N;  // nothing written past the plan: the caller fails
  std::fill(row_token_N, row_token_N + N, -1);
  std::fill(row_slot_N, row_slot_N + N, -1);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = tok_off[r] * K; i < tok_off[r + 1] * K; ++i) {
      const int64_t l = idx[i] - g.first;
      if (idx[i] < 0 || l < 0 || l >= L) {
        group_rows_GK[i] = -1;
        continue;
      }
      const int64_t row = chunk_LR[l * R + r]++;
      row_token_N[row] = static_cast<int32_t>(i / K);
      row_slot_N[row] = static_cast<int32_t>(i % K);
      group_rows_GK[i] = static_cast<int32_t>(row);
    }
  }
  *pads = pad;
  return N;
}

template <typename T>
void gather_row_probs(T* p_N, const T* probs_TK, const int32_t* row_token_N,
                      const int32_t* row_slot_N, int64_t N, int64_t K) {
#pragma omp parallel for simd schedule(static) if (N >= kParallelMin)
  for (int64_t r = 0; r < N; ++r) {
    const int32_t t = row_token_N[r];
    p_N[r] = t >= 0 ? probs_TK[int64_t(t) * K + row_slot_N[r]] : T(0);
  }
}

template <typename T>
void scatter_row_probs(T* dprobs_TK, const T* dp_N, const int32_t* token_rows_TK, int64_t TK) {
#pragma omp parallel for simd schedule(static) if (TK >= kParallelMin)
  for (int64_t i = 0; i < TK; ++i) {
    const int32_t r = token_rows_TK[i];
    dprobs_TK[i] = r >= 0 ? dp_N[r] : T(0);
  }
}

template <typename T>
void permute_rows(T* y_NH, const T* x_TH, const int32_t* row_token_N, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static) if (N * H >= kParallelMin)
  for (int64_t r = 0; r < N; ++r) {
    if (row_token_N[r] < 0) {
      std::fill(y_NH + r * H, y_NH + (r + 1) * H, T{});  // zero bits for float, double and bf16
    } else {
      std::memcpy(y_NH + r * H, x_TH + int64_t(row_token_N[r]) * H, sizeof(T) * size_t(H));
    }
  }
}

template <typename T>
void unpermute_rows(T* y_TH, const T* x_NH, const int32_t* token_rows_TK, int64_t n_tok, int64_t K,
                    int64_t H) {
#pragma omp parallel for schedule(static) if (n_tok * K * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    T* y = y_TH + t * H;
    for (int64_t h = 0; h < H; ++h) y[h] = T(0);
    for (int64_t k = 0; k < K; ++k) {  // k order: a fixed summation order, hence deterministic
      const int64_t r = token_rows_TK[t * K + k];
      if (r < 0) continue;
      const T* x = x_NH + r * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) y[h] += x[h];
    }
  }
}

void unpermute_rows(float* y_TH, const bf16* x_NH, const int32_t* token_rows_TK, int64_t n_tok,
                    int64_t K, int64_t H) {
#pragma omp parallel for schedule(static) if (n_tok * K * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    float* y = y_TH + t * H;
    for (int64_t h = 0; h < H; ++h) y[h] = 0.f;
    for (int64_t k = 0; k < K; ++k) {  // k order, as the f32 form
      const int64_t r = token_rows_TK[t * K + k];
      if (r < 0) continue;
      const uint16_t* x = reinterpret_cast<const uint16_t*>(x_NH + r * H);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) y[h] += bf16_bits_to_f32(x[h]);
    }
  }
}

template <typename T>
void copy_row_chunks(T* dst_NW, const T* src_NW, const int64_t* dst_off, const int64_t* src_off,
                     const int64_t* rows, int64_t n_chunks, int64_t W) {
  for (int64_t c = 0; c < n_chunks; ++c) {
    MOE_CHECK(rows[c] >= 0 && dst_off[c] >= 0 && src_off[c] >= 0,
              "[copy_row_chunks] chunk {}: {} rows from row {} to row {}", c, rows[c], src_off[c],
              dst_off[c]);
    if (rows[c] > 0) {
      std::memcpy(dst_NW + dst_off[c] * W, src_NW + src_off[c] * W, sizeof(T) * rows[c] * W);
    }
  }
}

template void copy_row_chunks<float>(float*, const float*, const int64_t*, const int64_t*,
                                     const int64_t*, int64_t, int64_t);
template void copy_row_chunks<double>(double*, const double*, const int64_t*, const int64_t*,
                                      const int64_t*, int64_t, int64_t);
template void copy_row_chunks<bf16>(bf16*, const bf16*, const int64_t*, const int64_t*,
                                    const int64_t*, int64_t, int64_t);
template void gather_row_probs<float>(float*, const float*, const int32_t*, const int32_t*, int64_t,
                                      int64_t);
template void gather_row_probs<double>(double*, const double*, const int32_t*, const int32_t*,
                                       int64_t, int64_t);
template void scatter_row_probs<float>(float*, const float*, const int32_t*, int64_t);
template void scatter_row_probs<double>(double*, const double*, const int32_t*, int64_t);
template void permute_rows<float>(float*, const float*, const int32_t*, int64_t, int64_t);
template void permute_rows<double>(double*, const double*, const int32_t*, int64_t, int64_t);
template void permute_rows<bf16>(bf16*, const bf16*, const int32_t*, int64_t, int64_t);
template void unpermute_rows<float>(float*, const float*, const int32_t*, int64_t, int64_t,
                                    int64_t);
template void unpermute_rows<double>(double*, const double*, const int32_t*, int64_t, int64_t,
                                     int64_t);

}  // namespace moecore::ops::cpu
