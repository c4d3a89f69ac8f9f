// Token embedding fast path. Ids are validated serially first (errors cannot leave an OpenMP
// region). The backward splits H into column blocks owned by one thread each and visits tokens
// in order, so repeated ids accumulate in a fixed order without atomics: bitwise reproducible.
#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "ops/embedding.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
// Columns per backward block: a few cache lines per row, enough blocks to feed the threads.
constexpr int64_t kColBlock = 64;

void check_ids(const int32_t* ids_T, int64_t n_tok, int64_t V) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t id = ids_T[t];
    MOE_CHECK(id >= 0 && id < V,
              "[embedding] token id {} at position {} outside [0, V={}): the data and "
              "--vocab-size disagree",
              id, t, V);
  }
}
}  // namespace

template <typename T>
void embedding_forward(T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok, int64_t H,
                       int64_t V) {
  check_ids(ids_T, n_tok, V);
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    std::memcpy(y_TH + t * H, w_VH + int64_t(ids_T[t]) * H, sizeof(T) * size_t(H));
  }
}

void embedding_forward_bf16(float* y_TH, const int32_t* ids_T, const bf16* w_VH, int64_t n_tok,
                            int64_t H, int64_t V) {
  check_ids(ids_T, n_tok, V);
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const bf16* w = w_VH + int64_t(ids_T[t]) * H;
    float* y = y_TH + t * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) y[h] = bf16_to_float(w[h]);
  }
}

template <typename T>
void embedding_backward(T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok, int64_t H,
                        int64_t V) {
  check_ids(ids_T, n_tok, V);
  const int64_t n_blocks = (H + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t h0 = b * kColBlock, h1 = std::min(H, h0 + kColBlock);
    for (int64_t t = 0; t < n_tok; ++t) {
      T* dw = dw_VH + int64_t(ids_T[t]) * H;
      const T* dy = dy_TH + t * H;
#pragma omp simd
      for (int64_t h = h0; h < h1; ++h) dw[h] += dy[h];
    }
  }
}

static void check_shard(int64_t v0, int64_t rows, int64_t V) {
  MOE_CHECK(v0 >= 0 && rows >= 0 && (rows == 0 || v0 + rows <= V),
            "[embedding] bad vocabulary slice: rows [{}, {}) of V={} (needs 0 <= v0, 0 <= rows, "
            "v0 + rows <= V unless the slice is empty: a TP rank of padding only)",
            v0, v0 + rows, V);
}

template <typename T>
void embedding_forward_shard(T* y_TH, const int32_t* ids_T, const T* w_RH, int64_t n_tok, int64_t H,
                             int64_t v0, int64_t rows, int64_t V) {
  check_shard(v0, rows, V);
  check_ids(ids_T, n_tok, V);
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t r = int64_t(ids_T[t]) - v0;
    if (r >= 0 && r < rows) {
      std::memcpy(y_TH + t * H, w_RH + r * H, sizeof(T) * size_t(H));
    } else {
      std::fill(y_TH + t * H, y_TH + (t + 1) * H, T(0));
    }
  }
}

template <typename T>
void embedding_backward_shard(T* dw_RH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                              int64_t H, int64_t v0, int64_t rows, int64_t V) {
  check_shard(v0, rows, V);
  check_ids(ids_T, n_tok, V);
  const int64_t n_blocks = (H + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (n_tok * H >= kParallelMin)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t h0 = b * kColBlock, h1 = std::min(H, h0 + kColBlock);
    for (int64_t t = 0; t < n_tok; ++t) {
      const int64_t r = int64_t(ids_T[t]) - v0;
      if (r < 0 || r >= rows) continue;
      T* dw = dw_RH + r * H;
      const T* dy = dy_TH + t * H;
#pragma omp simd
      for (int64_t h = h0; h < h1; ++h) dw[h] += dy[h];
    }
  }
}

template void embedding_forward_shard<float>(float*, const int32_t*, const float*, int64_t,
                                             int64_t, int64_t, int64_t, int64_t);
template void embedding_forward_shard<double>(double*, const int32_t*, const double*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t);
template void embedding_backward_shard<float>(float*, const float*, const int32_t*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t);
template void embedding_backward_shard<double>(double*, const double*, const int32_t*, int64_t,
                                               int64_t, int64_t, int64_t, int64_t);
template void embedding_forward<float>(float*, const int32_t*, const float*, int64_t, int64_t,
                                       int64_t);
template void embedding_forward<double>(double*, const int32_t*, const double*, int64_t, int64_t,
                                        int64_t);
template void embedding_backward<float>(float*, const float*, const int32_t*, int64_t, int64_t,
                                        int64_t);
template void embedding_backward<double>(double*, const double*, const int32_t*, int64_t, int64_t,
                                         int64_t);

}  // namespace moecore::ops::cpu
