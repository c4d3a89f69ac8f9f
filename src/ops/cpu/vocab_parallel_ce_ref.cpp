// Vocab-parallel cross entropy rows, reference: plain loops, exp and sums in f64. The oracle for
// vocab_parallel_ce.cpp.
#include <cmath>
#include <limits>

#include "core/check.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore::ops {

void VocabSlice::check() const {
  MOE_CHECK(V >= 1 && v0 >= 0 && Vl >= 0 && (Vl == 0 || v0 + Vl <= V),
            "[vocab_ce] bad vocabulary slice v0={} Vl={} of V={}: needs 0 <= v0, 0 <= Vl, "
            "v0 + Vl <= V unless the slice is empty (Vl = 0: a TP rank of padding only)",
            v0, Vl, V);
}

template <typename T>
void vocab_ce_row_max_ref(T* max_M, const T* z_MV, int64_t m, const VocabSlice& vs) {
  vs.check();
  for (int64_t i = 0; i < m; ++i) {
    T mx = vs.Vl > 0 ? z_MV[i * vs.Vl] : -std::numeric_limits<T>::infinity();
    for (int64_t v = 1; v < vs.Vl; ++v) mx = z_MV[i * vs.Vl + v] > mx ? z_MV[i * vs.Vl + v] : mx;
    max_M[i] = mx;
  }
}

template <typename T>
void vocab_ce_row_sums_ref(double* sums_2M, const T* z_MV, const T* max_M, const int32_t* target_M,
                           int64_t m, const VocabSlice& vs) {
  vs.check();
  for (int64_t i = 0; i < m; ++i) {
    const int32_t tgt = target_M[i];
    MOE_CHECK(tgt < vs.V,
              "[vocab_ce] target {} at row {} >= V={}: the data and --vocab-size "
              "disagree",
              tgt, i, vs.V);
    double se = 0;
    for (int64_t v = 0; v < vs.Vl; ++v)
      se += std::exp(double(z_MV[i * vs.Vl + v]) - double(max_M[i]));
    sums_2M[i] = se;
    const bool here = tgt >= 0 && tgt >= vs.v0 && tgt < vs.v0 + vs.Vl;
    sums_2M[m + i] = here ? double(z_MV[i * vs.Vl + (tgt - vs.v0)]) : 0.0;
  }
}

template <typename T>
void vocab_ce_finish_ref(double* sum, T* loss_M, T* lse_M, const T* max_M, const double* sums_2M,
                         const int32_t* target_M, int64_t m) {
  for (int64_t i = 0; i < m; ++i) {
    const double lse = double(max_M[i]) + std::log(sums_2M[i]);
    lse_M[i] = T(lse);
    loss_M[i] = target_M[i] >= 0 ? T(lse - sums_2M[m + i]) : T(0);
    *sum += double(loss_M[i]);
  }
}

template <typename T>
void vocab_ce_grad_ref(T* z_MV, const int32_t* target_M, const T* lse_M, T dloss, int64_t m,
                       const VocabSlice& vs) {
  vs.check();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t v = 0; v < vs.Vl; ++v) {
      T& z = z_MV[i * vs.Vl + v];
      if (target_M[i] < 0) {
        z = T(0);
        continue;
      }
      const double onehot = vs.v0 + v == target_M[i] ? 1.0 : 0.0;
      z = T((std::exp(double(z) - double(lse_M[i])) - onehot) * double(dloss));
    }
  }
}

#define MOECORE_VOCAB_CE_REF_INSTANTIATE(T)                                                      \
  template void vocab_ce_row_max_ref<T>(T*, const T*, int64_t, const VocabSlice&);               \
  template void vocab_ce_row_sums_ref<T>(double*, const T*, const T*, const int32_t*, int64_t,   \
                                         const VocabSlice&);                                     \
  template void vocab_ce_finish_ref<T>(double*, T*, T*, const T*, const double*, const int32_t*, \
                                       int64_t);                                                 \
  template void vocab_ce_grad_ref<T>(T*, const int32_t*, const T*, T, int64_t, const VocabSlice&);
MOECORE_VOCAB_CE_REF_INSTANTIATE(float)
MOECORE_VOCAB_CE_REF_INSTANTIATE(double)
#undef MOECORE_VOCAB_CE_REF_INSTANTIATE

}  // namespace moecore::ops
