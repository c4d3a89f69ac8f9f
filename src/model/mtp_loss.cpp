#include "model/mtp_loss.h"

#include "core/check.h"
#include "ops/token_layout.h"

namespace moecore::model {

template <typename T>
MtpLoss<T>::MtpLoss(const ModelConfig& cfg)
    : depths_(cfg.mtp_num_layers),
      depth_scale_(cfg.mtp_num_layers > 0
                       ? cfg.mtp_loss_scaling_factor / static_cast<double>(cfg.mtp_num_layers)
                       : 0.0) {}

template <typename T>
void MtpLoss<T>::allocate(Arena& a, int64_t S, int64_t B) {
  ex_ = &a.exec();
  B_ = B;
  T_ = S * B;
  targets_.assign(depths_, nullptr);
  lse_.assign(depths_, nullptr);
  h_.assign(depths_, nullptr);
  for (int64_t j = 0; j < depths_; ++j) {
    targets_[j] = a.alloc<int32_t>(T_, "mtp.targets");
    lse_[j] = a.alloc<T>(T_, "mtp.lse");
  }
  dloss_ = a.alloc<T>(1, "mtp.dloss", MemKind::Workspace);
}

template <typename T>
void MtpLoss<T>::forward(int64_t j, DevPtr<const T> h_k, DevPtr<const int32_t> targets_T,
                         DevPtr<ops::MicroBatchReport> report,
                         DevPtr<const int32_t> rolled_targets_BS) {
  const Exec& ex = *ex_;
  report_ = report;
  h_[j] = h_k;
  const int64_t shift = (j + 1) * B_;  // k = j + 1 positions ahead, sequence-major
  if (rolled_targets_BS != nullptr) {  // rolled on the whole sequences: only the layout changes
    ops::tokens_to_sequence_major(ex, targets_[j], targets_[j], ops::mtp_counted_ptr(report, j),
                                  rolled_targets_BS, rolled_targets_BS, B_, T_ / B_);
  } else {
    ops::roll_tokens(ex, targets_[j], ops::mtp_counted_ptr(report, j), targets_T, T_, shift, -1);
  }
  head_.forward(h_k, targets_[j], lse_[j], ops::mtp_loss_sum_ptr(report, j));
}

template <typename T>
void MtpLoss<T>::backward(int64_t j, DevPtr<T> dh_k, double loss_grad_scale) {
  const Exec& ex = *ex_;
  MOE_CHECK(report_ != nullptr, "[mtp] backward() without a forward");
  ops::loss_grad_scale(ex, dloss_, DevPtr<const int64_t>(ops::mtp_counted_ptr(report_, j)),
                       loss_grad_scale * depth_scale_);
  head_.backward(dh_k, h_[j], targets_[j], lse_[j], dloss_);
}

template class MtpLoss<float>;
template class MtpLoss<double>;

}  // namespace moecore::model
