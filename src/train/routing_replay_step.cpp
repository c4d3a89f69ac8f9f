// Routing replay in the training step (moe/routing_replay.h): the store's tables of an
// iteration, [global batch, S, K] per MoE layer, staged per micro-batch as the model's tables
// ([layers, B, S, K], MicroBatchIO::routing_BSK) before the step, and the recorded ones merged
// back after it.
#include <algorithm>

#include "core/check.h"
#include "train/trainer.h"

namespace moecore::train {

template <typename T>
void BasicTrainer<T>::check_routing_replay() {
  const std::shared_ptr<moe::RoutingReplay>& r = cfg_.routing_replay;
  if (!r) return;
  MOE_CHECK(model_cfg_.num_experts > 0,
            "[routing replay] the model has no MoE layers (--num-experts 0): nothing to replay");
  MOE_CHECK(r->samples() == cfg_.global_batch && r->seq_length() == model_cfg_.seq_length &&
                r->topk() == model_cfg_.moe.router.topk,
            "[routing replay] its tables hold {} samples of {} positions, top-{}, but this run "
            "has --global-batch-size {}, --seq-length {}, --moe-router-topk {}: replay a "
            "recording of the same batch and model",
            r->samples(), r->seq_length(), r->topk(), cfg_.global_batch, model_cfg_.seq_length,
            model_cfg_.moe.router.topk);
  model_cfg_.moe.routing_replay = r->mode();
}

template <typename T>
void BasicTrainer<T>::stage_routing(int64_t mb) {
  const moe::RoutingReplay& r = *cfg_.routing_replay;
  const int64_t B = cfg_.micro_batch, S = model_cfg_.seq_length, K = r.topk();
  const int64_t E = model_cfg_.num_experts, row = S * K;
  int32_t* out = step_->routing(mb);
  if (r.mode() == RoutingReplayMode::Record) {
    std::fill(out, out + static_cast<int64_t>(routing_layers_.size()) * B * row, -1);
    return;
  }
  const int64_t sample0 = step_->dropout(mb).sample0;
  for (size_t l = 0; l < routing_layers_.size(); ++l) {
    const std::vector<int32_t>& table = r.table(iteration_, routing_layers_[l]);
    for (int64_t b = 0; b < B; ++b) {
      const int32_t* src = table.data() + (sample0 + b) * row;
      for (int64_t i = 0; i < row; ++i) {
        MOE_CHECK(src[i] >= 0 && src[i] < E,
                  "[routing replay] iteration {} at {}: sample {} position {} has {} recorded "
                  "where an expert in [0, {}) was expected: replay a recording of every token of "
                  "the same model and global batch",
                  iteration_, routing_layers_[l], sample0 + b, i / K, src[i], E);
      }
      std::copy(src, src + row, out + (static_cast<int64_t>(l) * B + b) * row);
    }
  }
}

template <typename T>
void BasicTrainer<T>::record_routing() {
  moe::RoutingReplay& r = *cfg_.routing_replay;
  const int64_t B = cfg_.micro_batch, S = model_cfg_.seq_length, K = r.topk(), row = S * K;
  step_->download_routing();
  // The ranks holding the same layers: every rank of this pipeline stage.
  parallel::Communicator* stage =
      groups_ != nullptr && groups_->group(parallel::GroupKind::TpDpCp).size() > 1
          ? &groups_->group(parallel::GroupKind::TpDpCp).communicator()
          : nullptr;
  for (size_t l = 0; l < routing_layers_.size(); ++l) {
    routing_merge_.assign(static_cast<size_t>(r.samples() * row), -1);
    for (int64_t mb = 0; mb < n_micro_; ++mb) {
      const int64_t sample0 = step_->dropout(mb).sample0;
      const int32_t* src = step_->routing(mb) + static_cast<int64_t>(l) * B * row;
      std::copy(src, src + B * row, routing_merge_.data() + sample0 * row);
    }
    if (stage != nullptr) stage->all_reduce(routing_merge_, parallel::ReduceOp::Max);
    r.record_table(iteration_, routing_layers_[l]) = routing_merge_;
  }
}

template void BasicTrainer<float>::check_routing_replay();
template void BasicTrainer<double>::check_routing_replay();
template void BasicTrainer<float>::stage_routing(int64_t);
template void BasicTrainer<double>::stage_routing(int64_t);
template void BasicTrainer<float>::record_routing();
template void BasicTrainer<double>::record_routing();

}  // namespace moecore::train
