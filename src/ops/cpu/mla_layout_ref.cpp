// Plain-loop MLA layout: the oracle of mla_split / mla_merge (ops/mla_layout.h), element by
// element from the definitions.
#include "core/check.h"
#include "ops/mla_layout.h"

namespace moecore::ops {

void check_mla_layout_shape(const MlaLayoutShape& s, const char* op) {
  MOE_CHECK(s.n_tok >= 0 && s.heads >= 0 && s.qk >= 0 && s.pe >= 1 && s.dv >= 1,
            "[{}] bad shape n_tok={} heads={} qk={} pe={} dv={}: sizes >= 0, pe and dv >= 1", op,
            s.n_tok, s.heads, s.qk, s.pe, s.dv);
}

template <typename T>
void mla_split_ref(T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up, const T* k_pe,
                   const MlaLayoutShape& s, double q_scale) {
  check_mla_layout_shape(s, "mla_split_ref");
  const int64_t Dp = s.Dp(), dq = s.dq(), dkv = s.dkv();
  const T c = static_cast<T>(q_scale);
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t r = t * s.heads + h;
      for (int64_t j = 0; j < Dp; ++j) {
        q[r * Dp + j] = j < s.qk ? c * q_up[r * dq + j]
                        : j < dq ? c * q_pe[r * s.pe + (j - s.qk)]
                                 : T(0);
        k[r * Dp + j] = j < s.qk ? kv_up[r * dkv + j] : j < dq ? k_pe[t * s.pe + (j - s.qk)] : T(0);
        v[r * Dp + j] = j < s.dv ? kv_up[r * dkv + s.qk + j] : T(0);
      }
    }
  }
}

template <typename T>
void mla_merge_ref(T* dq_up, T* dq_pe, T* dkv_up, T* dk_pe, const T* dq, const T* dk, const T* dv,
                   const MlaLayoutShape& s, double q_scale) {
  check_mla_layout_shape(s, "mla_merge_ref");
  const int64_t Dp = s.Dp(), dqw = s.dq(), dkv = s.dkv();
  const T c = static_cast<T>(q_scale);
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t i = 0; i < s.pe; ++i) {
      T acc = T(0);
      for (int64_t h = 0; h < s.heads; ++h) acc += dk[(t * s.heads + h) * Dp + s.qk + i];
      dk_pe[t * s.pe + i] = acc;
    }
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t r = t * s.heads + h;
      for (int64_t j = 0; j < s.qk; ++j) {
        dq_up[r * dqw + j] = c * dq[r * Dp + j];
        dkv_up[r * dkv + j] = dk[r * Dp + j];
      }
      for (int64_t i = 0; i < s.pe; ++i) dq_pe[r * s.pe + i] = c * dq[r * Dp + s.qk + i];
      for (int64_t j = 0; j < s.dv; ++j) dkv_up[r * dkv + s.qk + j] = dv[r * Dp + j];
    }
  }
}

#define MOECORE_INSTANTIATE_MLA_LAYOUT_REF(T)                                        \
  template void mla_split_ref<T>(T*, T*, T*, const T*, const T*, const T*, const T*, \
                                 const MlaLayoutShape&, double);                     \
  template void mla_merge_ref<T>(T*, T*, T*, T*, const T*, const T*, const T*,       \
                                 const MlaLayoutShape&, double);
MOECORE_INSTANTIATE_MLA_LAYOUT_REF(float)
MOECORE_INSTANTIATE_MLA_LAYOUT_REF(double)
#undef MOECORE_INSTANTIATE_MLA_LAYOUT_REF

}  // namespace moecore::ops
