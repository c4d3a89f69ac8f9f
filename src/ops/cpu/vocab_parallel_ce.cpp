// Vocab-parallel cross entropy rows, fast path: OpenMP over rows (rows are independent, so the
// results do not depend on the thread count), exp through fast_exp in blocks of 256 summed in T
// and the blocks in f64, as the fused head's rows (ops/cpu/cross_entropy.cpp).
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "ops/cpu/fast_exp.h"
#include "ops/cpu/row_max.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore::ops::cpu {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

template <typename T>
void vocab_ce_row_max(T* max_M, const T* z_MV, int64_t m, const VocabSlice& vs) {
  vs.check();
  if (vs.Vl == 0) {  // a slice of padding only: the all-reduce's identity
    std::fill(max_M, max_M + m, -std::numeric_limits<T>::infinity());
    return;
  }
#pragma omp parallel for schedule(static) if (m * vs.Vl >= kParallelMin)
  for (int64_t i = 0; i < m; ++i) max_M[i] = row_max(z_MV + i * vs.Vl, vs.Vl);
}

template <typename T>
void vocab_ce_row_sums(double* sums_2M, const T* z_MV, const T* max_M, const int32_t* target_M,
                       int64_t m, const VocabSlice& vs) {
  vs.check();
  for (int64_t i = 0; i < m; ++i) {
    MOE_CHECK(target_M[i] < vs.V,
              "[vocab_ce] target {} at row {} >= V={}: the data and --vocab-size disagree",
              target_M[i], i, vs.V);
  }
  const int64_t Vl = vs.Vl;
#pragma omp parallel for schedule(static) if (m * Vl >= kParallelMin)
  for (int64_t i = 0; i < m; ++i) {
    const T* z = z_MV + i * Vl;
    const T mx = max_M[i];
    double se = 0;
    for (int64_t v0 = 0; v0 < Vl; v0 += 256) {
      const int64_t v1 = std::min(Vl, v0 + 256);
      T part = 0;
#pragma omp simd reduction(+ : part)
      for (int64_t v = v0; v < v1; ++v) part += fast_exp(z[v] - mx);
      se += double(part);
    }
    sums_2M[i] = se;
    const int64_t local = int64_t(target_M[i]) - vs.v0;
    sums_2M[m + i] = target_M[i] >= 0 && local >= 0 && local < Vl ? double(z[local]) : 0.0;
  }
}

template <typename T>
void vocab_ce_finish(double* sum, T* loss_M, T* lse_M, const T* max_M, const double* sums_2M,
                     const int32_t* target_M, int64_t m) {
  double total = *sum;
  for (int64_t i = 0; i < m; ++i) {
    const double lse = double(max_M[i]) + std::log(sums_2M[i]);
    lse_M[i] = T(lse);
    loss_M[i] = target_M[i] >= 0 ? T(lse - sums_2M[m + i]) : T(0);
    total += double(loss_M[i]);
  }
  *sum = total;
}

template <typename T>
void vocab_ce_grad(T* z_MV, const int32_t* target_M, const T* lse_M, T dloss, int64_t m,
                   const VocabSlice& vs) {
  vs.check();
  const int64_t Vl = vs.Vl;
#pragma omp parallel for schedule(static) if (m * Vl >= kParallelMin)
  for (int64_t i = 0; i < m; ++i) {
    T* z = z_MV + i * Vl;
    const int32_t tgt = target_M[i];
    if (tgt < 0) {
      std::fill(z, z + Vl, T(0));
      continue;
    }
    const T lse = lse_M[i];
    const int64_t local = int64_t(tgt) - vs.v0;
    const bool here = local >= 0 && local < Vl;
    const T zt = here ? z[local] : T(0);
#pragma omp simd
    for (int64_t v = 0; v < Vl; ++v) z[v] = fast_exp(z[v] - lse) * dloss;
    // The target's entry rounds as (e - 1) * dloss, as the fused head's.
    if (here) z[local] = (fast_exp(zt - lse) - T(1)) * dloss;
  }
}

#define MOECORE_VOCAB_CE_INSTANTIATE(T)                                                      \
  template void vocab_ce_row_max<T>(T*, const T*, int64_t, const VocabSlice&);               \
  template void vocab_ce_row_sums<T>(double*, const T*, const T*, const int32_t*, int64_t,   \
                                     const VocabSlice&);                                     \
  template void vocab_ce_finish<T>(double*, T*, T*, const T*, const double*, const int32_t*, \
                                   int64_t);                                                 \
  template void vocab_ce_grad<T>(T*, const int32_t*, const T*, T, int64_t, const VocabSlice&);
MOECORE_VOCAB_CE_INSTANTIATE(float)
MOECORE_VOCAB_CE_INSTANTIATE(double)
#undef MOECORE_VOCAB_CE_INSTANTIATE

}  // namespace moecore::ops::cpu
