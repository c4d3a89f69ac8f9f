#include "model/mtp_layer.h"

#include <fmt/format.h>

#include "core/check.h"
#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/memory.h"
#include "ops/permute.h"

namespace moecore::model {

template <typename T>
MtpLayer<T>::MtpLayer(const ModelConfig& cfg, int64_t depth, ParamRegistry& params,
                      const ops::RopeCache& rope, const parallel::ProcessGroups* groups,
                      uint64_t seed, const ops::RopeMlaCache* mla_rope)
    : tp_(parallel::TensorParallel::attention(groups)),
      H_(cfg.hidden),
      W_(cfg.hidden / tp_.size()),
      enorm_(norm_config(cfg), params, fmt::format("mtp.layers.{}.enorm", depth), tp_.token_role()),
      hnorm_(norm_config(cfg), params, fmt::format("mtp.layers.{}.hnorm", depth), tp_.token_role()),
      eh_proj_(&params.add(ParamSpec{fmt::format("mtp.layers.{}.eh_proj.weight", depth),
                                     {cfg.hidden, 2 * cfg.hidden},
                                     ParamInit::Normal,
                                     cfg.init_std,
                                     ParamKind::Dense,
                                     true,
                                     tp_.shard().slice(0, cfg.hidden),
                                     /*bf16_only=*/true,
                                     tp_.shard().sharded()})),
      block_(cfg, BlockSite::mtp(cfg, depth), params, rope, groups, seed, mla_rope),
      final_norm_(norm_config(cfg), params, fmt::format("mtp.layers.{}.final_layernorm", depth),
                  tp_.token_role()) {
  MOE_CHECK(cfg.hidden % tp_.size() == 0,
            "[mtp] --hidden-size {} is not divisible by --tensor-model-parallel-size {}: eh_proj "
            "is column-parallel over the hidden size",
            cfg.hidden, tp_.size());
}

template <typename T>
void MtpLayer<T>::allocate(Arena& a, int64_t S, int64_t B) {
  ex_ = &a.exec();
  n_tok_ = S * B;
  n_loc_ = tp_.local_tokens(n_tok_);
  const int64_t H = H_, n = n_loc_;
  block_.allocate(a, S, B);
  enorm_.allocate(a, n, "mtp.enorm_rstd");
  hnorm_.allocate(a, n, "mtp.hnorm_rstd");
  final_norm_.allocate(a, n, "mtp.final_rstd");
  en_ = a.alloc<T>(n * H, "mtp.enorm");
  hn_ = a.alloc<T>(n * H, "mtp.hnorm");
  x_ = a.alloc<T>(n * H, "mtp.eh_proj");
  y_ = a.alloc<T>(n * H, "mtp.layer_out");
  out_ = a.alloc<T>(n * H, "mtp.out");
  // Gradients and the TP region's buffers: live while this depth runs, beside its block's.
  Arena::Share workspace(a, "layer", block_.member(), {MemKind::Workspace});
  dy_ = a.alloc<T>(n * H, "mtp.dlayer_out", MemKind::Workspace);
  dx_ = a.alloc<T>(n * H, "mtp.deh_proj", MemKind::Workspace);
  den_ = a.alloc<T>(n * H, "mtp.denorm", MemKind::Workspace);
  dhn_ = a.alloc<T>(n * H, "mtp.dhnorm", MemKind::Workspace);
  // eh_proj's GEMMs run over the whole input under TP, this rank's tokens otherwise.
  const int64_t rows = tp_.active() ? n_tok_ : n_loc_;
  bf16_ = std::is_same_v<T, float> && eh_proj_->has_bf16_copy();
  if (bf16_) {
    in16_ = a.alloc<bf16>(rows * H, "mtp.eh_proj_in16", MemKind::Workspace);
    dy16_ = a.alloc<bf16>(rows * W_, "mtp.eh_proj_dy16", MemKind::Workspace);
    const Exec& ex = a.exec();
    const int64_t ws = std::max({ops::gemm_bf16_workspace_elems(ex, rows, W_, H),
                                 ops::gemm_bf16_workspace_elems(ex, W_, H, rows),
                                 ops::gemm_bf16_workspace_elems(ex, rows, H, W_)});
    if (ws > 0) ws32_ = a.alloc<float>(ws, "mtp.eh_proj_ws32", MemKind::Workspace);
  }
  if (!tp_.active()) return;
  const int tp = tp_.size();
  if (tp_.sequence_parallel()) {
    en_full_ = a.alloc<T>(n_tok_ * H, "mtp.enorm_full", MemKind::Workspace);
    hn_full_ = a.alloc<T>(n_tok_ * H, "mtp.hnorm_full", MemKind::Workspace);
    if (bf16_)
      in_wire16_ = a.alloc<bf16>(tp_.enter_wire_elems(n_tok_, H), "mtp.eh_proj_in_wire16",
                                 MemKind::Workspace);
  }
  y_cols_ = a.alloc<T>(n_tok_ * W_, "mtp.eh_proj_cols", MemKind::Workspace);
  gathered_ = a.alloc<T>(n_tok_ * H, "mtp.eh_proj_gathered", MemKind::Workspace);
  dfull_ = a.alloc<T>(n_tok_ * H, "mtp.dfull", MemKind::Workspace);
  fwd_map_ = a.alloc<int32_t>(n * tp, "mtp.gather_map", MemKind::State);
  bwd_map_ = a.alloc<int32_t>(n_tok_, "mtp.columns_map", MemKind::State);
  if (fwd_map_ == nullptr) return;  // the planning pass
  // Token-major row t * tp + r of this rank's [n, H] (as rows W wide) is rank r's output of
  // token t0 + t, row r * T + t0 + t of the gathered blocks; this rank's columns of token t are
  // row t * tp + rank of the whole gradient.
  const int64_t t0 = tp_.first_token(n_tok_);
  fwd_map_host_.resize(static_cast<size_t>(n * tp));
  for (int64_t t = 0; t < n; ++t) {
    for (int r = 0; r < tp; ++r)
      fwd_map_host_[static_cast<size_t>(t * tp + r)] = static_cast<int32_t>(r * n_tok_ + t0 + t);
  }
  bwd_map_host_.resize(static_cast<size_t>(n_tok_));
  for (int64_t t = 0; t < n_tok_; ++t)
    bwd_map_host_[static_cast<size_t>(t)] = static_cast<int32_t>(t * tp + tp_.rank());
  ops::copy<int32_t>(*ex_, fwd_map_, fwd_map_host_.data(), n * tp);
  ops::copy<int32_t>(*ex_, bwd_map_, bwd_map_host_.data(), n_tok_);
}

template <typename T>
void MtpLayer<T>::proj_gemms_forward(DevPtr<T> y, int64_t ldy, DevPtr<const T> en,
                                     DevPtr<const T> hn, int64_t n) {
  const Exec& ex = *ex_;
  const int64_t H = H_;
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {  // each input's bf16 values, the weight's bf16 copy (widened on that path)
      const DevPtr<const bf16> w16 = eh_proj_->data16;
      const DevPtr<const float> w32 = eh_proj_->data16w;
      ops::cast_f32_to_bf16(ex, in16_, en, n * H);
      ops::gemm_bf16(ex, false, true, n, W_, H, in16_, H, w16, 2 * H, 0.f, y, ldy, ws32_, w32);
      ops::cast_f32_to_bf16(ex, in16_, hn, n * H);
      ops::gemm_bf16(ex, false, true, n, W_, H, in16_, H, w16 == nullptr ? w16 : w16 + H, 2 * H,
                     1.f, y, ldy, ws32_, w32 == nullptr ? w32 : w32 + H);
      return;
    }
  }
  const DevPtr<const T> w = eh_proj_->data_as<T>();
  ops::gemm<T>(ex, false, true, n, W_, H, T(1), en, H, w, 2 * H, T(0), y, ldy);
  ops::gemm<T>(ex, false, true, n, W_, H, T(1), hn, H, w + H, 2 * H, T(1), y, ldy);
}

template <typename T>
void MtpLayer<T>::proj_gemms_backward(DevPtr<T> den, DevPtr<T> dhn, DevPtr<const T> dy, int64_t ldy,
                                      DevPtr<const T> en, DevPtr<const T> hn, int64_t n) {
  const Exec& ex = *ex_;
  const int64_t H = H_;
  const DevPtr<T> dw = eh_proj_->grad_as<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {
      const DevPtr<const bf16> w16 = eh_proj_->data16;
      const DevPtr<const float> w32 = eh_proj_->data16w;
      ops::cast_f32_to_bf16(ex, dy16_, dy, n * W_);  // dy is [n, W] here (ldy = W)
      ops::cast_f32_to_bf16(ex, in16_, en, n * H);
      ops::gemm_bf16(ex, true, false, W_, H, n, dy16_, W_, in16_, H, 1.f, dw, 2 * H, ws32_);
      ops::cast_f32_to_bf16(ex, in16_, hn, n * H);
      ops::gemm_bf16(ex, true, false, W_, H, n, dy16_, W_, in16_, H, 1.f, dw + H, 2 * H, ws32_);
      ops::gemm_bf16(ex, false, false, n, H, W_, dy16_, W_, w16, 2 * H, 0.f, den, H, ws32_, w32);
      ops::gemm_bf16(ex, false, false, n, H, W_, dy16_, W_, w16 == nullptr ? w16 : w16 + H, 2 * H,
                     0.f, dhn, H, ws32_, w32 == nullptr ? w32 : w32 + H);
      return;
    }
  }
  const DevPtr<const T> w = eh_proj_->data_as<T>();
  ops::gemm<T>(ex, true, false, W_, H, n, T(1), dy, ldy, en, H, T(1), dw, 2 * H);
  ops::gemm<T>(ex, true, false, W_, H, n, T(1), dy, ldy, hn, H, T(1), dw + H, 2 * H);
  ops::gemm<T>(ex, false, false, n, H, W_, T(1), dy, ldy, w, 2 * H, T(0), den, H);
  ops::gemm<T>(ex, false, false, n, H, W_, T(1), dy, ldy, w + H, 2 * H, T(0), dhn, H);
}

template <typename T>
void MtpLayer<T>::proj_forward() {
  const Exec& ex = *ex_;
  const int64_t H = H_;
  if (!tp_.active()) return proj_gemms_forward(x_, H, en_, hn_, n_loc_);
  // This rank's W output columns over every token, then all of them onto its tokens.
  const DevPtr<const T> en = tp_.enter(ex, DevPtr<const T>(en_), en_full_, n_tok_, H, in_wire16_);
  const DevPtr<const T> hn = tp_.enter(ex, DevPtr<const T>(hn_), hn_full_, n_tok_, H, in_wire16_);
  proj_gemms_forward(y_cols_, W_, en, hn, n_tok_);
  tp_.all_gather(ex, DevPtr<const T>(y_cols_), gathered_, n_tok_ * W_);
  ops::permute_rows<T>(ex, x_, gathered_, fwd_map_, n_loc_ * tp_.size(), W_);
}

template <typename T>
void MtpLayer<T>::proj_backward() {
  const Exec& ex = *ex_;
  const int64_t H = H_;
  if (!tp_.active()) return proj_gemms_backward(den_, dhn_, dx_, H, en_, hn_, n_loc_);
  // The gather's backward: this rank's columns of the whole output gradient (all-gathered over
  // the tokens with SP), into y_cols_.
  // Only eh_proj's bf16 GEMMs read it under --bf16: gathered as bf16 with SP.
  const DevPtr<const T> dfull =
      tp_.leave_backward(ex, DevPtr<const T>(dx_), dfull_, n_tok_, H, in_wire16_);
  ops::permute_rows<T>(ex, y_cols_, dfull, bwd_map_, n_tok_, W_);
  // The whole inputs again (SP: their gathers were workspace). Each input gradient's partial
  // sum over this rank's columns (into dfull_ and the gather's buffer, free by now), then
  // summed over TP.
  const DevPtr<const T> en = tp_.enter(ex, DevPtr<const T>(en_), en_full_, n_tok_, H, in_wire16_);
  const DevPtr<const T> hn = tp_.enter(ex, DevPtr<const T>(hn_), hn_full_, n_tok_, H, in_wire16_);
  proj_gemms_backward(dfull_, gathered_, y_cols_, W_, en, hn, n_tok_);
  tp_.enter_backward(ex, dfull_, den_, n_tok_, H);
  tp_.enter_backward(ex, gathered_, dhn_, n_tok_, H);
}

template <typename T>
void MtpLayer<T>::forward(DevPtr<const T> h_prev, DevPtr<const T> e, bool recompute) {
  const Exec& ex = *ex_;
  h_prev_ = h_prev;
  e_ = e;
  enorm_.forward(ex, en_, e, n_loc_);
  hnorm_.forward(ex, hn_, h_prev, n_loc_);
  proj_forward();
  block_.forward(y_, x_, recompute);
  final_norm_.forward(ex, out_, DevPtr<const T>(y_), n_loc_);
}

template <typename T>
void MtpLayer<T>::backward(DevPtr<T> dh_prev, DevPtr<T> de, DevPtr<const T> dout,
                           double loss_grad_scale) {
  const Exec& ex = *ex_;
  final_norm_.backward(ex, dy_, dout, y_, n_loc_);
  block_.backward(dx_, dy_, loss_grad_scale);
  proj_backward();
  enorm_.backward(ex, de, den_, e_, n_loc_);
  hnorm_.backward(ex, dh_prev, dhn_, h_prev_, n_loc_);
}

template class MtpLayer<float>;
template class MtpLayer<double>;

}  // namespace moecore::model
