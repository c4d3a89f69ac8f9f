// Router softmax and top-k fast path: OpenMP over tokens; top-k is a partial insertion
// selection into the output row (K is small, E <= 256), so nothing is allocated or sorted.
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "ops/softmax_topk.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

template <typename T>
void softmax_forward(T* y_TE, const T* x_TE, int64_t n_tok, int64_t E) {
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* x = x_TE + t * E;
    T* y = y_TE + t * E;  // may alias x: each x[e] is read before y[e] is written
    T m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t e = 0; e < E; ++e) m = std::max(m, x[e]);
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < E; ++e) {
      y[e] = std::exp(x[e] - m);
      s += y[e];
    }
    // A row of all -inf gives NaN (0/0), as the reference and PyTorch do.
    const T inv = T(1) / s;
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) y[e] *= inv;
  }
}

template <typename T>
void softmax_backward(T* dx_TE, const T* dy_TE, const T* y_TE, int64_t n_tok, int64_t E) {
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) {
    const T* dy = dy_TE + t * E;
    const T* y = y_TE + t * E;
    T* dx = dx_TE + t * E;  // may alias dy: dot is complete before any write
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t e = 0; e < E; ++e) dot += dy[e] * y[e];
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) dx[e] = y[e] * (dy[e] - dot);
  }
}

template <typename T>
void topk(int32_t* idx_TK, T* val_TK, const T* x_TE, int64_t n_tok, int64_t E, int64_t K) {
  MOE_CHECK(K >= 1 && K <= E, "[topk] K={} outside [1, E={}]: lower --moe-router-topk", K, E);
#pragma omp parallel for schedule(static) if (n_tok * E >= kParallelMin)
  for (int64_t t = 0; t < n_tok; ++t) topk_row(idx_TK + t * K, val_TK + t * K, x_TE + t * E, E, K);
}

template void softmax_forward<float>(float*, const float*, int64_t, int64_t);
template void softmax_forward<double>(double*, const double*, int64_t, int64_t);
template void softmax_backward<float>(float*, const float*, const float*, int64_t, int64_t);
template void softmax_backward<double>(double*, const double*, const double*, int64_t, int64_t);
template void topk<float>(int32_t*, float*, const float*, int64_t, int64_t, int64_t);
template void topk<double>(int32_t*, double*, const double*, int64_t, int64_t, int64_t);

}  // namespace moecore::ops::cpu
