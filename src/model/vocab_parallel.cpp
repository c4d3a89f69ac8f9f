#include "model/vocab_parallel.h"

#include <algorithm>
#include <type_traits>

#include "core/check.h"
#include "ops/cast.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/memory.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore::model {

VocabShard vocab_shard(const parallel::TensorParallel& tp, int64_t V, int64_t Vp) {
  MOE_CHECK(V >= 1 && Vp >= V, "[model] the padded vocabulary {} is smaller than the vocabulary {}",
            Vp, V);
  MOE_CHECK(Vp % tp.size() == 0,
            "[model] the padded vocabulary {} is not divisible by --tensor-model-parallel-size {}: "
            "pad it with --make-vocab-size-divisible-by (the vocabulary is padded to a multiple "
            "of that times the TP size)",
            Vp, tp.size());
  VocabShard s;
  s.v0 = tp.share_offset(Vp);
  s.rows = tp.share(Vp);
  s.model = std::clamp<int64_t>(V - s.v0, 0, s.rows);
  s.slice = ops::VocabSlice{s.v0, s.model, V};
  return s;
}

namespace {
// The fused head's shape at this rank's share of the padded vocabulary (its GEMMs' largest
// shapes: the model rows are at most the share).
ops::HeadLossShape local_shape(const parallel::TensorParallel& tp, const ops::HeadLossShape& s,
                               int64_t Vp) {
  return ops::HeadLossShape{s.n_tok, s.H, tp.share(Vp), s.chunk};
}

// The head's operand forms (ops::HeadLossBf16): checked once per call; h's bf16 form written
// by the forward (convert_h).
template <typename T>
void prepare_bf16(const Exec& ex, const ops::HeadLossBf16* ops16, DevPtr<const T> h_nH,
                  const ops::HeadLossShape& s, bool convert_h) {
  if (ops16 == nullptr) return;
  MOE_CHECK((std::is_same_v<T, float>), "[model] the bf16 vocab-parallel head needs an f32 model");
  if constexpr (std::is_same_v<T, float>) {
    if (ops16->w_VH_wide != nullptr) {
      MOE_CHECK(ops16->h32 != nullptr, "[model] widened bf16 head weights need the h32 workspace");
      if (convert_h) ops::round_f32_to_bf16(ex, ops16->h32, h_nH, s.n_tok * s.H);
      return;
    }
    MOE_CHECK(ops16->w_VH != nullptr && ops16->h16 != nullptr && ops16->dz16 != nullptr,
              "[model] the bf16 vocab-parallel head needs the slice's bf16 weights and the h16 "
              "and dz16 workspaces");
    if (convert_h) ops::cast_f32_to_bf16(ex, ops16->h16, h_nH, s.n_tok * s.H);
  }
}

// z [m, Vl] = the chunk's local logits: h rows [c0, c0 + m) times the slice's rows, on bf16
// values with f32 accumulation under bf16 (the fused head's chunk_logits).
template <typename T>
void local_logits(const Exec& ex, DevPtr<T> z, DevPtr<const T> h_nH, DevPtr<const T> w_local,
                  int64_t c0, int64_t m, int64_t H, int64_t Vl, const ops::HeadLossBf16* ops16) {
  if constexpr (std::is_same_v<T, float>) {
    if (ops16 != nullptr && ops16->w_VH_wide != nullptr) {
      return ops::gemm<float>(ex, false, true, m, Vl, H, 1.f, DevPtr<const float>(ops16->h32) + c0 * H,
                              H, ops16->w_VH_wide, H, 0.f, z, Vl);
    }
    if (ops16 != nullptr) {
      return ops::gemm_bf16(ex, false, true, m, Vl, H, DevPtr<const moecore::bf16>(ops16->h16) + c0 * H, H,
                            ops16->w_VH, H, 0.f, z, Vl, ops16->ws32);
    }
  }
  ops::gemm<T>(ex, false, true, m, Vl, H, T(1), h_nH + c0 * H, H, w_local, H, T(0), z, Vl);
}
}  // namespace

int64_t vocab_head_bf16_workspace_elems(const Exec& ex, const parallel::TensorParallel& tp,
                                        const ops::HeadLossShape& s, int64_t Vp) {
  return ops::head_loss_bf16_workspace_elems(ex, local_shape(tp, s, Vp));
}

template <typename T>
void vocab_parallel_embedding_forward(const Exec& ex, const parallel::TensorParallel& tp,
                                      DevPtr<T> y_local, DevPtr<T> partial_nH,
                                      DevPtr<const int32_t> ids_n, DevPtr<const T> w_local,
                                      int64_t n, int64_t H, int64_t V, int64_t Vp) {
  const VocabShard vs = vocab_shard(tp, V, Vp);
  ops::embedding_forward_shard(ex, partial_nH, ids_n, w_local, n, H, vs.v0, vs.model, V);
  tp.leave(ex, partial_nH, y_local, n, H);
}

void vocab_parallel_embedding_forward_bf16(const Exec& ex, const parallel::TensorParallel& tp,
                                           DevPtr<float> y_local, DevPtr<float> partial_nH,
                                           DevPtr<const int32_t> ids_n,
                                           DevPtr<const moecore::bf16> w16_local,
                                           DevPtr<float> w32_local, int64_t n, int64_t H, int64_t V,
                                           int64_t Vp) {
  ops::cast_bf16_to_f32(ex, w32_local, w16_local, vocab_shard(tp, V, Vp).model * H);
  vocab_parallel_embedding_forward<float>(ex, tp, y_local, partial_nH, ids_n,
                                          DevPtr<const float>(w32_local), n, H, V, Vp);
}

template <typename T>
void vocab_parallel_embedding_backward(const Exec& ex, const parallel::TensorParallel& tp,
                                       DevPtr<T> dw_local, DevPtr<const T> dy_local,
                                       DevPtr<T> full_nH, DevPtr<const int32_t> ids_n, int64_t n,
                                       int64_t H, int64_t V, int64_t Vp) {
  const VocabShard vs = vocab_shard(tp, V, Vp);
  const DevPtr<const T> dy = tp.leave_backward(ex, dy_local, full_nH, n, H);
  ops::embedding_backward_shard(ex, dw_local, dy, ids_n, n, H, vs.v0, vs.model, V);
}

template <typename T>
void vocab_parallel_head_loss_forward(const Exec& ex, const parallel::TensorParallel& tp,
                                      DevPtr<double> sum, DevPtr<T> loss_n, DevPtr<T> lse_n,
                                      DevPtr<const T> h_nH, DevPtr<const T> w_local,
                                      DevPtr<const int32_t> target_n, const ops::HeadLossShape& s,
                                      int64_t Vp, const VocabHeadWorkspace<T>& ws,
                                      const ops::HeadLossBf16* ops16) {
  const ops::VocabSlice vs = vocab_shard(tp, s.V, Vp).slice;
  const int64_t H = s.H, Vl = vs.Vl;  // the model's rows of this rank's slice (maybe none)
  prepare_bf16(ex, ops16, h_nH, s, /*convert_h=*/true);
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    // No model rows: no logits (the row pieces give the reductions' identities).
    if (Vl > 0) local_logits(ex, ws.logits, h_nH, w_local, c0, m, H, Vl, ops16);
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
                                       const ops::HeadLossShape& s, int64_t Vp,
                                       const VocabHeadWorkspace<T>& ws,
                                       const ops::HeadLossBf16* ops16) {
  const ops::VocabSlice vs = vocab_shard(tp, s.V, Vp).slice;
  const int64_t H = s.H, Vl = vs.Vl;  // the model's rows of this rank's slice (maybe none)
  prepare_bf16(ex, ops16, h_nH, s, /*convert_h=*/false);
  if (Vl == 0) {
    // A rank of padding only: its vocabulary columns give no gradient (dh's share is zero,
    // assigned as the GEMM would; the slice's weight gradient gains nothing).
    ops::zero(ex, dh_nH, s.n_tok * H);
    return;
  }
  for (int64_t c0 = 0; c0 < s.n_tok; c0 += s.chunk) {
    const int64_t m = std::min(s.chunk, s.n_tok - c0);
    local_logits(ex, ws.logits, h_nH, w_local, c0, m, H, Vl, ops16);
    ops::vocab_ce_grad(ex, ws.logits, target_n + c0, lse_n + c0, dloss, m, vs);
    if constexpr (std::is_same_v<T, float>) {
      // The f32 dlogits rounded to bf16 (as the fused head's softmax_grad_row_bf16[w]), then
      // the two GEMMs on bf16 values with f32 accumulation.
      if (ops16 != nullptr && ops16->w_VH_wide != nullptr) {
        ops::round_f32_to_bf16(ex, ws.logits, DevPtr<const float>(ws.logits), m * Vl);
        ops::gemm<float>(ex, false, false, m, H, Vl, 1.f, DevPtr<const float>(ws.logits), Vl,
                         ops16->w_VH_wide, H, 0.f, dh_nH + c0 * H, H);
        ops::gemm<float>(ex, true, false, Vl, H, m, 1.f, DevPtr<const float>(ws.logits), Vl,
                         DevPtr<const float>(ops16->h32) + c0 * H, H, 1.f, dw_local, H);
        continue;
      }
      if (ops16 != nullptr) {
        ops::cast_f32_to_bf16(ex, ops16->dz16, DevPtr<const float>(ws.logits), m * Vl);
        ops::gemm_bf16(ex, false, false, m, H, Vl, DevPtr<const moecore::bf16>(ops16->dz16), Vl, ops16->w_VH,
                       H, 0.f, dh_nH + c0 * H, H, ops16->ws32);
        ops::gemm_bf16(ex, true, false, Vl, H, m, DevPtr<const moecore::bf16>(ops16->dz16), Vl,
                       DevPtr<const moecore::bf16>(ops16->h16) + c0 * H, H, 1.f, dw_local, H, ops16->ws32);
        continue;
      }
    }
    ops::gemm<T>(ex, false, false, m, H, Vl, T(1), DevPtr<const T>(ws.logits), Vl, w_local, H, T(0),
                 dh_nH + c0 * H, H);
    ops::gemm<T>(ex, true, false, Vl, H, m, T(1), DevPtr<const T>(ws.logits), Vl, h_nH + c0 * H, H,
                 T(1), dw_local, H);
  }
}

#define MOECORE_VOCAB_PARALLEL_INSTANTIATE(T)                                                      \
  template void vocab_parallel_embedding_forward<T>(                                               \
      const Exec&, const parallel::TensorParallel&, DevPtr<T>, DevPtr<T>, DevPtr<const int32_t>,   \
      DevPtr<const T>, int64_t, int64_t, int64_t, int64_t);                                        \
  template void vocab_parallel_embedding_backward<T>(                                              \
      const Exec&, const parallel::TensorParallel&, DevPtr<T>, DevPtr<const T>, DevPtr<T>,         \
      DevPtr<const int32_t>, int64_t, int64_t, int64_t, int64_t);                                  \
  template void vocab_parallel_head_loss_forward<T>(                                               \
      const Exec&, const parallel::TensorParallel&, DevPtr<double>, DevPtr<T>, DevPtr<T>,          \
      DevPtr<const T>, DevPtr<const T>, DevPtr<const int32_t>, const ops::HeadLossShape&, int64_t, \
      const VocabHeadWorkspace<T>&, const ops::HeadLossBf16*);                                     \
  template void vocab_parallel_head_loss_backward<T>(                                              \
      const Exec&, const parallel::TensorParallel&, DevPtr<T>, DevPtr<T>, DevPtr<const T>,         \
      DevPtr<const T>, DevPtr<const int32_t>, DevPtr<const T>, DevPtr<const T>,                    \
      const ops::HeadLossShape&, int64_t, const VocabHeadWorkspace<T>&, const ops::HeadLossBf16*);
MOECORE_VOCAB_PARALLEL_INSTANTIATE(float)
MOECORE_VOCAB_PARALLEL_INSTANTIATE(double)
#undef MOECORE_VOCAB_PARALLEL_INSTANTIATE

}  // namespace moecore::model
