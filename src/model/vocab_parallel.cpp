#include "model/vocab_parallel.h"

#include "core/check.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore::model {

namespace {
ops::VocabSlice vocab_slice(const parallel::TensorParallel& tp, int64_t V) {
  MOE_CHECK(V % tp.size() == 0,
            "[model] the padded vocabulary {} is not divisible by --tensor-model-parallel-size {}: "
            "pad it with --make-vocab-size-divisible-by (the vocabulary is padded to a multiple "
            "of that times the TP size)",
            V, tp.size());
  return ops::VocabSlice{tp.share_offset(V), tp.share(V), V};
}
}  // namespace

template <typename T>
void vocab_parallel_embedding_forward(const Exec& ex, const parallel::TensorParallel& tp,
                                      DevPtr<T> y_local, DevPtr<T> partial_nH,
                                      DevPtr<const int32_t> ids_n, DevPtr<const T> w_local,
                                      int64_t n, int64_t H, int64_t V) {
  const ops::VocabSlice vs = vocab_slice(tp, V);
  ops::embedding_forward_shard(ex, partial_nH, ids_n, w_local, n, H, vs.v0, vs.Vl, V);
  tp.leave(ex, partial_nH, y_local, n, H);
}

template <typename T>
void vocab_parallel_embedding_backward(const Exec& ex, const parallel::TensorParallel& tp,
                                       DevPtr<T> dw_local, DevPtr<const T> dy_local,
                                       DevPtr<T> full_nH, DevPtr<const int32_t> ids_n, int64_t n,
                                       int64_t H, int64_t V) {
  const ops::VocabSlice vs = vocab_slice(tp, V);
  const DevPtr<const T> dy = tp.leave_backward(ex, dy_local, full_nH, n, H);
  ops::embedding_backward_shard(ex, dw_local, dy, ids_n, n, H, vs.v0, vs.Vl, V);
}

template <typename T>
void vocab_parallel_head_loss_forward(const Exec& ex, const parallel::TensorParallel& tp,
                                      DevPtr<double> sum, DevPtr<T> loss_n, DevPtr<T> lse_n,
                                      DevPtr<const T> h_nH, DevPtr<const T> w_local,
                                      DevPtr<const int32_t> target_n, const ops::HeadLossShape& s,
                                      const VocabHeadWorkspace<T>& ws) {
  const ops::VocabSlice vs = vocab_slice(tp, s.V);
  const int64_t H = s.H, Vl = vs.Vl;
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    ops::gemm<T>(ex, false, true, m, Vl, H, T(1), h_nH + c0 * H, H, w_local, H, T(0), ws.logits,
                 Vl);
    ops::vocab_ce_row_max(ex, ws.max, DevPtr<const T>(ws.logits), m, vs);
    tp.all_reduce_max(ex, ws.max, m);
    ops::vocab_ce_row_sums(ex, ws.sums, DevPtr<const T>(ws.logits), DevPtr<const T>(ws.max),
                           target_n + c0, m, vs);
    tp.all_reduce(ex, ws.sums, 2 * m);
    ops::vocab_ce_finish(ex, sum, loss_n + c0, lse_n + c0, DevPtr<const T>(ws.max),
                         DevPtr<const double>(ws.sums), target_n + c0, m);
  }
}

template <typename T>
void vocab_parallel_head_loss_backward(const Exec& ex, const parallel::TensorParallel& tp,
                                       DevPtr<T> dh_nH, DevPtr<T> dw_local, DevPtr<const T> h_nH,
                                       DevPtr<const T> w_local, DevPtr<const int32_t> target_n,
                                       DevPtr<const T> lse_n, DevPtr<const T> dloss,
                                       const ops::HeadLossShape& s,
                                       const VocabHeadWorkspace<T>& ws) {
  const ops::VocabSlice vs = vocab_slice(tp, s.V);
  const int64_t H = s.H, Vl = vs.Vl;
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    ops::gemm<T>(ex, false, true, m, Vl, H, T(1), h_nH + c0 * H, H, w_local, H, T(0), ws.logits,
                 Vl);
    ops::vocab_ce_grad(ex, ws.logits, target_n + c0, lse_n + c0, dloss, m, vs);
    ops::gemm<T>(ex, false, false, m, H, Vl, T(1), DevPtr<const T>(ws.logits), Vl, w_local, H, T(0),
                 dh_nH + c0 * H, H);
    ops::gemm<T>(ex, true, false, Vl, H, m, T(1), DevPtr<const T>(ws.logits), Vl, h_nH + c0 * H, H,
                 T(1), dw_local, H);
  }
}

#define MOECORE_VOCAB_PARALLEL_INSTANTIATE(T)                                                     \
  template void vocab_parallel_embedding_forward<T>(const Exec&, const parallel::TensorParallel&, \
                                                    DevPtr<T>, DevPtr<T>, DevPtr<const int32_t>,  \
                                                    DevPtr<const T>, int64_t, int64_t, int64_t);  \
  template void vocab_parallel_embedding_backward<T>(                                             \
      const Exec&, const parallel::TensorParallel&, DevPtr<T>, DevPtr<const T>, DevPtr<T>,        \
      DevPtr<const int32_t>, int64_t, int64_t, int64_t);                                          \
  template void vocab_parallel_head_loss_forward<T>(                                              \
      const Exec&, const parallel::TensorParallel&, DevPtr<double>, DevPtr<T>, DevPtr<T>,         \
      DevPtr<const T>, DevPtr<const T>, DevPtr<const int32_t>, const ops::HeadLossShape&,         \
      const VocabHeadWorkspace<T>&);                                                              \
  template void vocab_parallel_head_loss_backward<T>(                                             \
      const Exec&, const parallel::TensorParallel&, DevPtr<T>, DevPtr<T>, DevPtr<const T>,        \
      DevPtr<const T>, DevPtr<const int32_t>, DevPtr<const T>, DevPtr<const T>,                   \
      const ops::HeadLossShape&, const VocabHeadWorkspace<T>&);
MOECORE_VOCAB_PARALLEL_INSTANTIATE(float)
MOECORE_VOCAB_PARALLEL_INSTANTIATE(double)
#undef MOECORE_VOCAB_PARALLEL_INSTANTIATE

}  // namespace moecore::model
