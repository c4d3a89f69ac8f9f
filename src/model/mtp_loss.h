// Multi-token prediction's losses on the stage with the loss (Megatron-Core's process_mtp_loss):
// depth k = j + 1's hidden states h_k [T_local, H] (from the MTP layers beside it, or split off
// the boundary activation a standalone MTP stage sent: the decoder's hidden states and every
// depth's, concatenated) go through the model's shared output head against the targets rolled k
// positions ahead (ops::roll_tokens: the last k positions count nothing); the sum of the cross
// entropy goes to the report slot's mtp_loss_sum[j], the counted targets to mtp_counted[j]. The
// backward seeds each counted token with (--mtp-loss-scaling-factor / D) * loss_grad_scale /
// counted_k (Megatron's MTPLossAutoScaler) and assigns the gradient of h_k.
// Legend: T tokens, T_local this rank's, H hidden, D depths.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "ops/step_report.h"

namespace moecore::model {

template <typename T>
class MtpLoss {
 public:
  // The model's output head fused with the cross entropy (GPTModel's), over sequence-major tokens.
  struct Head {
    // lse_T saved, *sum = the cross entropy summed over the counted tokens of h_local.
    std::function<void(DevPtr<const T> h_local, DevPtr<const int32_t> targets_T, DevPtr<T> lse_T,
                       DevPtr<double> sum)>
        forward;
    // *dloss per counted token: dh_local assigned, the head's gradient accumulated.
    std::function<void(DevPtr<T> dh_local, DevPtr<const T> h_local, DevPtr<const int32_t> targets_T,
                       DevPtr<const T> lse_T, DevPtr<const T> dloss)>
        backward;
  };

  explicit MtpLoss(const ModelConfig& cfg);
  void allocate(Arena& a, int64_t S, int64_t B);
  void set_head(Head head) { head_ = std::move(head); }
  int64_t depths() const { return depths_; }

  // Depth j's loss of h_k [T_local, H] (the caller's until the backward) against targets_T [T]
  // (sequence-major) rolled j + 1 ahead, into *report (kept for the backward). rolled_targets_BS
  // (null: rolled here): depth j's targets already rolled on the whole sequences, [B, S]
  // batch-major (context parallelism, MtpBlock::forward).
  void forward(int64_t j, DevPtr<const T> h_k, DevPtr<const int32_t> targets_T,
               DevPtr<ops::MicroBatchReport> report,
               DevPtr<const int32_t> rolled_targets_BS = nullptr);
  // dh_k [T_local, H] assigned: the gradient of depth j's loss times loss_grad_scale.
  void backward(int64_t j, DevPtr<T> dh_k, double loss_grad_scale);

 private:
  const Exec* ex_ = &cpu_exec();
  int64_t depths_, B_ = 0, T_ = 0;
  double depth_scale_;  // --mtp-loss-scaling-factor / D
  Head head_;
  // Per depth [D]: the rolled targets [T], the head's log-sum-exp [T], its input h_k.
  std::vector<DevPtr<int32_t>> targets_;
  std::vector<DevPtr<T>> lse_;
  std::vector<DevPtr<const T>> h_;
  DevPtr<ops::MicroBatchReport> report_ = nullptr;  // the last forward's
  DevPtr<T> dloss_ = nullptr;  // [1] the running depth's d(loss) / d(each token's CE)
};

}  // namespace moecore::model
