#include "model/mtp_block.h"

#include <fmt/format.h>

#include "core/check.h"
#include "core/rng.h"
#include "ops/add.h"
#include "ops/token_layout.h"

namespace moecore::model {

template <typename T>
MtpBlock<T>::MtpBlock(const ModelConfig& cfg, ParamRegistry& params, const ops::RopeCache& rope,
                      const parallel::ProcessGroups* groups, uint64_t seed,
                      const ops::RopeMlaCache* mla_rope)
    : H_(cfg.hidden),
      E_(cfg.num_experts),
      depth_scale_(cfg.mtp_num_layers > 0
                       ? cfg.mtp_loss_scaling_factor / static_cast<double>(cfg.mtp_num_layers)
                       : 0.0) {
  for (int64_t j = 0; j < cfg.mtp_num_layers; ++j) {
    layers_.push_back(std::make_unique<MtpLayer<T>>(cfg, j, params, rope, groups, seed, mla_rope));
    drop_key_.push_back(rng_key(seed, fmt::format("mtp.layers.{}.embedding.dropout", j)));
  }
}

template <typename T>
void MtpBlock<T>::allocate(Arena& a, int64_t S, int64_t B, int64_t T_local, bool positions) {
  ex_ = &a.exec();
  B_ = B;
  T_ = S * B;
  T_local_ = T_local;
  const int64_t D = depths();
  ids_.assign(D, nullptr);
  targets_.assign(D, nullptr);
  pos_.assign(D, nullptr);
  emb_.assign(D, nullptr);
  lse_.assign(D, nullptr);
  for (int64_t j = 0; j < D; ++j) {
    layers_[j]->allocate(a, S, B);
    ids_[j] = a.alloc<int32_t>(T_, "mtp.ids");
    targets_[j] = a.alloc<int32_t>(T_, "mtp.targets");
    if (positions) pos_[j] = a.alloc<int32_t>(T_, "mtp.positions");
    emb_[j] = a.alloc<T>(T_local * H_, "mtp.embedding");
    lse_[j] = a.alloc<T>(T_, "mtp.lse");
  }
  // The backward's gradients cross from one depth to the one before: plain workspace, not a
  // depth's member of the per-layer overlay (the next depth's layer would overwrite them).
  dloss_ = a.alloc<T>(1, "mtp.dloss", MemKind::Workspace);
  dhead_ = a.alloc<T>(T_local * H_, "mtp.dhead", MemKind::Workspace);
  dcarry_ = a.alloc<T>(T_local * H_, "mtp.dcarry", MemKind::Workspace);
  demb_ = a.alloc<T>(T_local * H_, "mtp.dembedding", MemKind::Workspace);
}

template <typename T>
void MtpBlock<T>::forward(DevPtr<const T> h0, DevPtr<const int32_t> ids_T,
                          DevPtr<const int32_t> targets_T, DevPtr<const int32_t> pos_T,
                          DevPtr<ops::MicroBatchReport> report, DevPtr<int64_t> tokens_per_expert_E,
                          bool replay, DevPtr<const int32_t> rolled_ids_BS,
                          DevPtr<const int32_t> rolled_targets_BS) {
  const Exec& ex = *ex_;
  report_ = report;
  DevPtr<const T> h = h0;
  for (int64_t j = 0; j < depths(); ++j) {
    const int64_t shift = (j + 1) * B_;  // k = j + 1 positions ahead, sequence-major
    if (rolled_ids_BS != nullptr) {
      MOE_CHECK(pos_T == nullptr, "[mtp] pre-rolled tokens with learned positions");
      ops::tokens_to_sequence_major(ex, ids_[j], targets_[j], ops::mtp_counted_ptr(report, j),
                                    rolled_ids_BS + j * T_, rolled_targets_BS + j * T_, B_,
                                    T_ / B_);
    } else {
      ops::roll_tokens(ex, ids_[j], DevPtr<int64_t>(nullptr), ids_T, T_, shift, 0);
      ops::roll_tokens(ex, targets_[j], ops::mtp_counted_ptr(report, j), targets_T, T_, shift,
                       -1);
      if (pos_T != nullptr)
        ops::roll_tokens(ex, pos_[j], DevPtr<int64_t>(nullptr), pos_T, T_, shift, 0);
    }
    ends_.embed(emb_[j], ids_[j], pos_[j], drop_key_[j]);
    MtpLayer<T>& layer = *layers_[j];
    layer.forward(h, emb_[j], replay);
    if (layer.block().is_moe() && !replay) {
      const moe::RouterReport r = layer.block().moe()->router().report();
      ops::report_moe_layer(ex, report, tokens_per_expert_E, r.aux_value, r.z_value, r.dropped,
                            r.tokens_per_expert_E, E_);
    }
    ends_.head_forward(layer.out(), targets_[j], lse_[j], ops::mtp_loss_sum_ptr(report, j));
    h = layer.out();
  }
}

template <typename T>
void MtpBlock<T>::backward(DevPtr<T> dh0, double loss_grad_scale) {
  const Exec& ex = *ex_;
  MOE_CHECK(report_ != nullptr, "[mtp] backward() without a forward");
  const int64_t n = T_local_ * H_;
  for (int64_t j = depths() - 1; j >= 0; --j) {
    MtpLayer<T>& layer = *layers_[j];
    ops::loss_grad_scale(ex, dloss_, DevPtr<const int64_t>(ops::mtp_counted_ptr(report_, j)),
                         loss_grad_scale * depth_scale_);
    ends_.head_backward(dhead_, layer.out(), targets_[j], lse_[j], dloss_);
    // h_k also feeds depth k + 1, whose gradient was carried here.
    if (j + 1 < depths())
      ops::add(ex, dhead_, DevPtr<const T>(dhead_), DevPtr<const T>(dcarry_), n);
    layer.backward(j == 0 ? dh0 : dcarry_, demb_, dhead_, loss_grad_scale);
    ends_.embed_backward(demb_, ids_[j], pos_[j], drop_key_[j]);
  }
}

template class MtpBlock<float>;
template class MtpBlock<double>;

}  // namespace moecore::model
