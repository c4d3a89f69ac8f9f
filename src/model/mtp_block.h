// Multi-token prediction's D depths (DeepSeek-V3; Megatron-Core's MultiTokenPredictionBlock and
// process_mtp_loss), run on the stage with the loss after the decoder's final norm. Depth
// k = 1..D (layer j = k - 1):
//   ids_k, targets_k: the sequence-major ids and targets rolled k positions ahead
//     (ops::roll_tokens, Megatron's roll_tensor: the last k positions take id 0 and no target),
//     with counted_k the targets that count;
//   e_k = the model's embedding of ids_k (the shared table, one gradient; learned positions
//     rolled alike; the embedding dropout on the depth's own stream);
//   h_k = MtpLayer_j(h_{k-1}, e_k), h_0 the decoder's final-normed output;
//   loss_k = the shared output head's cross entropy of h_k against targets_k: its sum goes to the
//     report slot's mtp_loss_sum[j], counted_k to mtp_counted[j].
// The gradient: (--mtp-loss-scaling-factor / D) * loss_grad_scale / counted_k for each counted
// token of depth k (Megatron's MTPLossAutoScaler: the main loss's backward scale, the
// loss_grad_scale path of the routers' aux losses), back through the depths into h_0, the table
// and the head. The MoE layers among the depths report their routing into the slot like the
// decoder's. The embedding and the head are the model's (Ends): the block owns the depths, the
// rolled tokens and what the heads save.
// Legend: T tokens, T_local this rank's (tp.local_tokens(T)), H hidden, D depths.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "model/mtp_layer.h"
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
    // The head's cross entropy of h_local [T_local, H] against targets_T: lse_T saved, *sum = the
    // sum over the counted tokens.
    std::function<void(DevPtr<const T> h_local, DevPtr<const int32_t> targets_T, DevPtr<T> lse_T,
                       DevPtr<double> sum)>
        head_forward;
    // Its backward with *dloss per counted token: dh_local assigned, the head's gradient
    // accumulated.
    std::function<void(DevPtr<T> dh_local, DevPtr<const T> h_local, DevPtr<const int32_t> targets_T,
                       DevPtr<const T> lse_T, DevPtr<const T> dloss)>
        head_backward;
  };

  MtpBlock(const ModelConfig& cfg, ParamRegistry& params, const ops::RopeCache& rope,
           const parallel::ProcessGroups* groups, uint64_t seed, const ops::RopeMlaCache* mla_rope);
  // positions: the model has learned positions (each depth keeps its rolled ones).
  void allocate(Arena& a, int64_t S, int64_t B, int64_t T_local, bool positions);
  void set_ends(Ends ends) { ends_ = std::move(ends); }

  // h0 [T_local, H] the decoder's final-normed output, ids_T / targets_T / pos_T (null without
  // learned positions) [T] sequence-major; all the caller's until the backward. The depths'
  // losses and counts go to *report (kept for the backward), their MoE layers' routing too
  // unless replaying (the recomputation for the backward: the same values, no balancing counts).
  // rolled_ids_BS / rolled_targets_BS (null: rolled here from ids_T / targets_T): every depth's
  // ids and targets already rolled on the whole sequences, [D, B, S] batch-major (context
  // parallelism: a rank's S positions are two chunks of the sequence, so the roll must happen
  // before the split; learned positions are not supported then).
  void forward(DevPtr<const T> h0, DevPtr<const int32_t> ids_T, DevPtr<const int32_t> targets_T,
               DevPtr<const int32_t> pos_T, DevPtr<ops::MicroBatchReport> report,
               DevPtr<int64_t> tokens_per_expert_E, bool replay,
               DevPtr<const int32_t> rolled_ids_BS = nullptr,
               DevPtr<const int32_t> rolled_targets_BS = nullptr);
  // dh0 [T_local, H] assigned: the gradient of h0 from every depth.
  void backward(DevPtr<T> dh0, double loss_grad_scale);

  int64_t depths() const { return static_cast<int64_t>(layers_.size()); }
  MtpLayer<T>& layer(int64_t j) { return *layers_[j]; }
  const MtpLayer<T>& layer(int64_t j) const { return *layers_[j]; }

 private:
  const Exec* ex_ = &cpu_exec();
  int64_t B_ = 0, T_ = 0, T_local_ = 0, H_, E_;
  double depth_scale_;  // --mtp-loss-scaling-factor / D
  Ends ends_;
  std::vector<std::unique_ptr<MtpLayer<T>>> layers_;
  std::vector<uint64_t> drop_key_;  // the depths' embedding dropout streams
  // Per depth [D]: the rolled ids, targets and positions [T], the embedding [T_local, H], the
  // head's log-sum-exp [T].
  std::vector<DevPtr<int32_t>> ids_, targets_, pos_;
  std::vector<DevPtr<T>> emb_, lse_;
  DevPtr<ops::MicroBatchReport> report_ = nullptr;  // the last forward's
  DevPtr<T> dloss_ = nullptr;  // [1] the running depth's d(loss) / d(each token's CE)
  // [T_local, H]: a head's input gradient, the gradient carried to the depth before, an
  // embedding's gradient.
  DevPtr<T> dhead_ = nullptr, dcarry_ = nullptr, demb_ = nullptr;
};

}  // namespace moecore::model
