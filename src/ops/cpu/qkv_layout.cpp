// QKV split / fuse: one memcpy per head group part, OpenMP over tokens.
#include <cstring>

#include "core/check.h"
#include "ops/qkv_layout.h"

namespace moecore::ops::cpu {
namespace {

void check(const QkvShape& s) {
  MOE_CHECK(s.n_tok >= 0 && s.Hkv >= 1 && s.D >= 1 && s.Hq >= s.Hkv && s.Hq % s.Hkv == 0,
            "[qkv] n_tok={} Hq={} Hkv={} D={}: the query heads must be a multiple of the KV "
            "heads",
            s.n_tok, s.Hq, s.Hkv, s.D);
}

// Calls copy(fused offset, part (0 q, 1 k, 2 v), offset in that part, length) for every
// contiguous piece: per token and query group, its query heads, key head and value head.
template <typename Copy>
void for_each_piece(const QkvShape& s, Copy copy) {
  check(s);
  const int64_t qpg = s.Hq / s.Hkv, D = s.D, row = (s.Hq + 2 * s.Hkv) * D;
#pragma omp parallel for schedule(static) if (s.n_tok * row >= (int64_t{1} << 14))
  for (int64_t t = 0; t < s.n_tok; ++t) {
    for (int64_t g = 0; g < s.Hkv; ++g) {
      const int64_t f = t * row + g * (qpg + 2) * D;
      copy(f, 0, (t * s.Hq + g * qpg) * D, qpg * D);
      copy(f + qpg * D, 1, (t * s.Hkv + g) * D, D);
      copy(f + (qpg + 1) * D, 2, (t * s.Hkv + g) * D, D);
    }
  }
}

}  // namespace

template <typename T>
void split_qkv(T* q, T* k, T* v, const T* fused, const QkvShape& s) {
  T* parts[3] = {q, k, v};
  for_each_piece(s, [&](int64_t f, int p, int64_t o, int64_t len) {
    std::memcpy(parts[p] + o, fused + f, sizeof(T) * len);
  });
}

template <typename T>
void fuse_qkv(T* fused, const T* q, const T* k, const T* v, const QkvShape& s) {
  const T* parts[3] = {q, k, v};
  for_each_piece(s, [&](int64_t f, int p, int64_t o, int64_t len) {
    std::memcpy(fused + f, parts[p] + o, sizeof(T) * len);
  });
}

template void split_qkv<float>(float*, float*, float*, const float*, const QkvShape&);
template void split_qkv<double>(double*, double*, double*, const double*, const QkvShape&);
template void fuse_qkv<float>(float*, const float*, const float*, const float*, const QkvShape&);
template void fuse_qkv<double>(double*, const double*, const double*, const double*,
                               const QkvShape&);

}  // namespace moecore::ops::cpu
