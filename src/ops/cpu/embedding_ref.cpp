// Token embedding reference: plain loops. The backward adds rows in token order, which is the
// order the fast path keeps, so the two agree bitwise.
#include "core/check.h"
#include "ops/embedding.h"

namespace moecore::ops {

namespace {
int64_t checked_id(const int32_t* ids_T, int64_t t, int64_t V) {
  const int64_t id = ids_T[t];
  MOE_CHECK(id >= 0 && id < V,
            "[embedding] token id {} at position {} outside [0, V={}): the data and "
            "--vocab-size disagree",
            id, t, V);
  return id;
}
void check_slice(int64_t v0, int64_t rows, int64_t V) {
  MOE_CHECK(v0 >= 0 && rows >= 0 && (rows == 0 || v0 + rows <= V),
            "[embedding] bad vocabulary slice: rows [{}, {}) of V={} (needs 0 <= v0, 0 <= rows, "
            "v0 + rows <= V unless the slice is empty: a TP rank of padding only)",
            v0, v0 + rows, V);
}
}  // namespace

template <typename T>
void embedding_forward_ref(T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok,
                           int64_t H, int64_t V) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t id = checked_id(ids_T, t, V);
    for (int64_t h = 0; h < H; ++h) y_TH[t * H + h] = w_VH[id * H + h];
  }
}

void embedding_forward_bf16_ref(float* y_TH, const int32_t* ids_T, const bf16* w_VH, int64_t n_tok,
                                int64_t H, int64_t V) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t id = checked_id(ids_T, t, V);
    for (int64_t h = 0; h < H; ++h) y_TH[t * H + h] = bf16_to_float(w_VH[id * H + h]);
  }
}

template <typename T>
void embedding_backward_ref(T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                            int64_t H, int64_t V) {
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t id = checked_id(ids_T, t, V);
    for (int64_t h = 0; h < H; ++h) dw_VH[id * H + h] += dy_TH[t * H + h];
  }
}

template <typename T>
void embedding_forward_shard_ref(T* y_TH, const int32_t* ids_T, const T* w_RH, int64_t n_tok,
                                 int64_t H, int64_t v0, int64_t rows, int64_t V) {
  check_slice(v0, rows, V);
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t id = checked_id(ids_T, t, V);
    const bool here = id >= v0 && id < v0 + rows;
    for (int64_t h = 0; h < H; ++h) y_TH[t * H + h] = here ? w_RH[(id - v0) * H + h] : T(0);
  }
}

template <typename T>
void embedding_backward_shard_ref(T* dw_RH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                                  int64_t H, int64_t v0, int64_t rows, int64_t V) {
  check_slice(v0, rows, V);
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t id = checked_id(ids_T, t, V);
    if (id < v0 || id >= v0 + rows) continue;
    for (int64_t h = 0; h < H; ++h) dw_RH[(id - v0) * H + h] += dy_TH[t * H + h];
  }
}

template void embedding_forward_shard_ref<float>(float*, const int32_t*, const float*, int64_t,
                                                 int64_t, int64_t, int64_t, int64_t);
template void embedding_forward_shard_ref<double>(double*, const int32_t*, const double*, int64_t,
                                                  int64_t, int64_t, int64_t, int64_t);
template void embedding_backward_shard_ref<float>(float*, const float*, const int32_t*, int64_t,
                                                  int64_t, int64_t, int64_t, int64_t);
template void embedding_backward_shard_ref<double>(double*, const double*, const int32_t*, int64_t,
                                                   int64_t, int64_t, int64_t, int64_t);
template void embedding_forward_ref<float>(float*, const int32_t*, const float*, int64_t, int64_t,
                                           int64_t);
template void embedding_forward_ref<double>(double*, const int32_t*, const double*, int64_t,
                                            int64_t, int64_t);
template void embedding_backward_ref<float>(float*, const float*, const int32_t*, int64_t,
                                            int64_t, int64_t);
template void embedding_backward_ref<double>(double*, const double*, const int32_t*, int64_t,
                                             int64_t, int64_t);

}  // namespace moecore::ops
