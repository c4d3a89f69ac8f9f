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
    : H_(cfg.hidden), E_(cfg.num_experts) {
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
  pos_.assign(D, nullptr);
  emb_.assign(D, nullptr);
  for (int64_t j = 0; j < D; ++j) {
    layers_[j]->allocate(a, S, B);
    ids_[j] = a.alloc<int32_t>(T_, "mtp.ids");
    if (positions) pos_[j] = a.alloc<int32_t>(T_, "mtp.positions");
    emb_[j] = a.alloc<T>(T_local * H_, "mtp.embedding");
  }
  // The backward's gradients cross from one depth to the one before: plain workspace, not a
  // depth's member of the per-layer overlay (the next depth's layer would overwrite them).
  dhead_ = a.alloc<T>(T_local * H_, "mtp.dhead", MemKind::Workspace);
  dcarry_ = a.alloc<T>(T_local * H_, "mtp.dcarry", MemKind::Workspace);
  demb_ = a.alloc<T>(T_local * H_, "mtp.dembedding", MemKind::Workspace);
  ids_count_ = a.alloc<int64_t>(1, "mtp.ids_count", MemKind::Workspace);
}

template <typename T>
void MtpBlock<T>::forward(DevPtr<const T> h0, DevPtr<const int32_t> ids_T,
                          DevPtr<const int32_t> targets_T, DevPtr<const int32_t> pos_T,
                          DevPtr<ops::MicroBatchReport> report, DevPtr<int64_t> tokens_per_expert_E,
                          bool replay, DevPtr<const int32_t> rolled_ids_BS,
                          DevPtr<const int32_t> rolled_targets_BS) {
  const Exec& ex = *ex_;
  forwarded_ = true;
  DevPtr<const T> h = h0;
  for (int64_t j = 0; j < depths(); ++j) {
    const int64_t shift = (j + 1) * B_;  // k = j + 1 positions ahead, sequence-major
    if (rolled_ids_BS != nullptr) {
      // The ids already rolled on the whole sequences (context parallelism): only their layout
      // changes. The op copies ids and targets alike; the ids stand in for both here, and the
      // count it takes of them is not used.
      MOE_CHECK(pos_T == nullptr, "[mtp] pre-rolled tokens with learned positions");
      const DevPtr<const int32_t> rolled = rolled_ids_BS + j * T_;
      ops::tokens_to_sequence_major(ex, ids_[j], ids_[j], ids_count_, rolled, rolled, B_, T_ / B_);
    } else {
      ops::roll_tokens(ex, ids_[j], DevPtr<int64_t>(nullptr), ids_T, T_, shift, 0);
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
    if (loss_ != nullptr)
      loss_->forward(j, layer.out(), targets_T, report,
                     rolled_targets_BS != nullptr ? rolled_targets_BS + j * T_ : nullptr);
    h = layer.out();
  }
}

template <typename T>
void MtpBlock<T>::backward(DevPtr<T> dh0, double loss_grad_scale, DevPtr<const T> dh_k) {
  const Exec& ex = *ex_;
  MOE_CHECK(forwarded_, "[mtp] backward() without a forward");
  MOE_CHECK(loss_ != nullptr || dh_k != nullptr,
            "[mtp] the depths' backward needs their losses or the gradients of their outputs");
  const int64_t n = T_local_ * H_;
  for (int64_t j = depths() - 1; j >= 0; --j) {
    MtpLayer<T>& layer = *layers_[j];
    // The gradient of h_k: its loss's (here, or sent back by the loss's stage), plus depth
    // k + 1's, carried here.
    DevPtr<const T> dout = dhead_;
    if (loss_ != nullptr) {
      loss_->backward(j, dhead_, loss_grad_scale);
      if (j + 1 < depths())
        ops::add(ex, dhead_, DevPtr<const T>(dhead_), DevPtr<const T>(dcarry_), n);
    } else if (j + 1 < depths()) {
      ops::add(ex, dhead_, dh_k + j * n, DevPtr<const T>(dcarry_), n);
    } else {
      dout = dh_k + j * n;
    }
    layer.backward(j == 0 ? dh0 : dcarry_, demb_, dout, loss_grad_scale);
    ends_.embed_backward(demb_, ids_[j], pos_[j], drop_key_[j]);
  }
}

template class MtpBlock<float>;
template class MtpBlock<double>;

}  // namespace moecore::model
