// MLA layout on the CPU: tokens split across OpenMP threads; each output element is one copy,
// one product by the q scale, or (dk_pe) a sum over the heads in head order: the reference's
// operations, so bitwise the reference at any thread count.
#include "ops/mla_layout.h"
#include "core/check.h"

namespace moecore::ops::cpu {

template <typename T>
void mla_split(T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up, const T* k_pe,
               const MlaLayoutShape& s, double q_scale) {
  check_mla_layout_shape(s, "mla_split");
  const int64_t Dp = s.Dp(), dq = s.dq(), dkv = s.dkv(), qk = s.qk, pe = s.pe, dv = s.dv;
  const T c = static_cast<T>(q_scale);
#pragma omp parallel for schedule(static) if (s.n_tok * s.heads * Dp >= (int64_t{1} << 15))
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t r = t * s.heads + h;
      T* qr = q + r * Dp;
      T* kr = k + r * Dp;
      T* vr = v + r * Dp;
      const T* qu = q_up + r * dq;
      const T* qp = q_pe + r * pe;
      const T* kv = kv_up + r * dkv;
      const T* kp = k_pe + t * pe;
      for (int64_t j = 0; j < qk; ++j) qr[j] = c * qu[j], kr[j] = kv[j];
      for (int64_t i = 0; i < pe; ++i) qr[qk + i] = c * qp[i], kr[qk + i] = kp[i];
      for (int64_t j = dq; j < Dp; ++j) qr[j] = T(0), kr[j] = T(0);
      for (int64_t j = 0; j < dv; ++j) vr[j] = kv[qk + j];
      for (int64_t j = dv; j < Dp; ++j) vr[j] = T(0);
    }
  }
}

template <typename T>
void mla_merge(T* dq_up, T* dq_pe, T* dkv_up, T* dk_pe, const T* dq, const T* dk, const T* dv,
               const MlaLayoutShape& s, double q_scale) {
  check_mla_layout_shape(s, "mla_merge");
  const int64_t Dp = s.Dp(), dqw = s.dq(), dkv = s.dkv(), qk = s.qk, pe = s.pe;
  const T c = static_cast<T>(q_scale);
#pragma omp parallel for schedule(static) if (s.n_tok * s.heads * Dp >= (int64_t{1} << 15))
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t i = 0; i < pe; ++i) {
      T acc = T(0);
      for (int64_t h = 0; h < s.heads; ++h) acc += dk[(t * s.heads + h) * Dp + qk + i];
      dk_pe[t * pe + i] = acc;
    }
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t r = t * s.heads + h;
      const T* gq = dq + r * Dp;
      const T* gk = dk + r * Dp;
      const T* gv = dv + r * Dp;
      T* qu = dq_up + r * dqw;
      T* kv = dkv_up + r * dkv;
      for (int64_t j = 0; j < qk; ++j) qu[j] = c * gq[j], kv[j] = gk[j];
      for (int64_t i = 0; i < pe; ++i) dq_pe[r * pe + i] = c * gq[qk + i];
      for (int64_t j = 0; j < s.dv; ++j) kv[qk + j] = gv[j];
    }
  }
}

#define MOECORE_INSTANTIATE_MLA_LAYOUT(T)                                                         \
  template void mla_split<T>(T*, T*, T*, const T*, const T*, const T*, const T*,                  \
                             const MlaLayoutShape&, double);                                      \
  template void mla_merge<T>(T*, T*, T*, T*, const T*, const T*, const T*, const MlaLayoutShape&, \
                             double);
MOECORE_INSTANTIATE_MLA_LAYOUT(float)
MOECORE_INSTANTIATE_MLA_LAYOUT(double)
#undef MOECORE_INSTANTIATE_MLA_LAYOUT

}  // namespace moecore::ops::cpu
