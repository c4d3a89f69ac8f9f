// QKV split / fuse element by element from the layout's definition: the oracle of
// qkv_layout.cpp.
#include "ops/qkv_layout.h"

namespace moecore::ops {
namespace {
// Column of (head h of kind 0 = q, 1 = k, 2 = v, element d) in a fused row.
int64_t fused_col(const QkvShape& s, int kind, int64_t h, int64_t d) {
  const int64_t qpg = s.Hq / s.Hkv;
  const int64_t g = kind == 0 ? h / qpg : h;
  const int64_t within = kind == 0 ? h % qpg : qpg + (kind - 1);
  return (g * (qpg + 2) + within) * s.D + d;
}
}  // namespace

template <typename T>
void split_qkv_ref(T* q, T* k, T* v, const T* fused, const QkvShape& s) {
  const int64_t row = (s.Hq + 2 * s.Hkv) * s.D;
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t d = 0; d < s.D; ++d) {
      for (int64_t h = 0; h < s.Hq; ++h) q[(t * s.Hq + h) * s.D + d] = fused[t * row + fused_col(s, 0, h, d)];
      for (int64_t h = 0; h < s.Hkv; ++h) {
        k[(t * s.Hkv + h) * s.D + d] = fused[t * row + fused_col(s, 1, h, d)];
        v[(t * s.Hkv + h) * s.D + d] = fused[t * row + fused_col(s, 2, h, d)];
      }
    }
  }
}

template <typename T>
void fuse_qkv_ref(T* fused, const T* q, const T* k, const T* v, const QkvShape& s) {
  const int64_t row = (s.Hq + 2 * s.Hkv) * s.D;
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t d = 0; d < s.D; ++d) {
      for (int64_t h = 0; h < s.Hq; ++h) fused[t * row + fused_col(s, 0, h, d)] = q[(t * s.Hq + h) * s.D + d];
      for (int64_t h = 0; h < s.Hkv; ++h) {
        fused[t * row + fused_col(s, 1, h, d)] = k[(t * s.Hkv + h) * s.D + d];
        fused[t * row + fused_col(s, 2, h, d)] = v[(t * s.Hkv + h) * s.D + d];
      }
    }
  }
}

template void split_qkv_ref<float>(float*, float*, float*, const float*, const QkvShape&);
template void split_qkv_ref<double>(double*, double*, double*, const double*, const QkvShape&);
template void fuse_qkv_ref<float>(float*, const float*, const float*, const float*,
                                  const QkvShape&);
template void fuse_qkv_ref<double>(double*, const double*, const double*, const double*,
                                   const QkvShape&);

}  // namespace moecore::ops
