// Multi-token prediction's D depths (DeepSeek-V3; Megatron-Core's MultiTokenPredictionBlock),
// run after the decoder's final norm, on the stage with the loss or on a pipeline stage of their
// own before it. Depth k = 1..D (layer j = k - 1):
//   ids_k: the sequence-major ids rolled k positions ahead (ops::roll_tokens, Megatron's
//     roll_tensor: the last k positions take id 0);
//   e_k = the model's embedding of ids_k (the shared table, one gradient; learned positions
//     rolled alike; the embedding dropout on the depth's own stream);
//   h_k = MtpLayer_j(h_{k-1}, e_k), h_0 the decoder's final-normed output;
// and with the loss beside them (model/mtp_loss.h, attached with set_loss) each h_k's loss right
// after its layer. On a stage before the loss's the block stops at the h_k: the model sends them
// on after h_0, and the backward takes their gradients from the loss's stage instead of the heads.
// The gradient of each loss flows back through the depths into h_0, the table and the head. The
// MoE layers among the depths report their routing into the slot like the decoder's. The
// embedding is the model's (Ends): the block owns the depths, the rolled ids and positions.
// Legend: T tokens, T_local this rank's (tp.local_tokens(T)), H hidden, D depths.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "model/mtp_layer.h"
#include "model/mtp_loss.h"
#include "ops/step_report.h"

namespace moecore::model {

template <typename T>
class MtpBlock {
 public:
  // What the depths borrow from the model (GPTModel), over sequence-major tokens.
  struct Ends {
    // x_local [T_local, H] = dropout(table[ids] + positions[pos]) (pos null: no learned
    // positions), dropout on the stream `key` (training only).
    std::function<void(DevPtr<T> x_local, DevPtr<const int32_t> ids_T, DevPtr<const int32_t> pos_T,
                       uint64_t key)>
        embed;
    // Its backward: the table's (and positions') gradients accumulated from dx_local, which it
    // may overwrite.
    std::function<void(DevPtr<T> dx_local, DevPtr<const int32_t> ids_T, DevPtr<const int32_t> pos_T,
                       uint64_t key)>
        embed_backward;
  };

  MtpBlock(const ModelConfig& cfg, ParamRegistry& params, const ops::RopeCache& rope,
           const parallel::ProcessGroups* groups, uint64_t seed, const ops::RopeMlaCache* mla_rope);
  // positions: the model has learned positions (each depth keeps its rolled ones).
  void allocate(Arena& a, int64_t S, int64_t B, int64_t T_local, bool positions);
  void set_ends(Ends ends) { ends_ = std::move(ends); }
  // The depths' losses, computed right after each depth (the block beside the loss); null: a
  // stage before the loss's (the default).
  void set_loss(MtpLoss<T>* loss) { loss_ = loss; }

  // h0 [T_local, H] the decoder's final-normed output, ids_T / targets_T / pos_T (null without
  // learned positions) [T] sequence-major; all the caller's until the backward. With the loss the
  // depths' losses and counts go to *report (targets_T is read only then); their MoE layers'
  // routing does unless replaying (the recomputation for the backward: the same values, no
  // balancing counts). Depth j's h_k is layer(j).out().
  // rolled_ids_BS / rolled_targets_BS (null: rolled here from ids_T / targets_T): every depth's
  // ids and targets already rolled on the whole sequences, [D, B, S] batch-major (context
  // parallelism: a rank's S positions are two chunks of the sequence, so the roll must happen
  // before the split; learned positions are not supported then).
  void forward(DevPtr<const T> h0, DevPtr<const int32_t> ids_T, DevPtr<const int32_t> targets_T,
               DevPtr<const int32_t> pos_T, DevPtr<ops::MicroBatchReport> report,
               DevPtr<int64_t> tokens_per_expert_E, bool replay,
               DevPtr<const int32_t> rolled_ids_BS = nullptr,
               DevPtr<const int32_t> rolled_targets_BS = nullptr);
  // dh0 [T_local, H] assigned: the gradient of h0 from every depth. With the loss the depths'
  // losses are the source; without it dh_k holds the gradients of h_1 .. h_D, [D, T_local, H]
  // (what the loss's stage sent back; not written).
  void backward(DevPtr<T> dh0, double loss_grad_scale, DevPtr<const T> dh_k = nullptr);

  int64_t depths() const { return static_cast<int64_t>(layers_.size()); }
  MtpLayer<T>& layer(int64_t j) { return *layers_[j]; }
  const MtpLayer<T>& layer(int64_t j) const { return *layers_[j]; }

 private:
  const Exec* ex_ = &cpu_exec();
  int64_t B_ = 0, T_ = 0, T_local_ = 0, H_, E_;
  Ends ends_;
  MtpLoss<T>* loss_ = nullptr;
  std::vector<std::unique_ptr<MtpLayer<T>>> layers_;
  std::vector<uint64_t> drop_key_;  // the depths' embedding dropout streams
  // Per depth [D]: the rolled ids and positions [T], the embedding [T_local, H].
  std::vector<DevPtr<int32_t>> ids_, pos_;
  std::vector<DevPtr<T>> emb_;
  DevPtr<int64_t> ids_count_ = nullptr;  // [1] the unused count of the pre-rolled ids' layout change
  bool forwarded_ = false;
  // [T_local, H]: a head's input gradient, the gradient carried to the depth before, an
  // embedding's gradient.
  DevPtr<T> dhead_ = nullptr, dcarry_ = nullptr, demb_ = nullptr;
};

}  // namespace moecore::model
