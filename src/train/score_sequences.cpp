// Scoring token sequences (`moecore eval --tokens-json`): each sequence's summed cross entropy
// from the evaluation's forward in the training layout, the sequences laid out as the global
// batch's micro-batches (one per micro-batch, padded; the padding's targets ignored).
#include <algorithm>

#include "core/check.h"
#include "core/sync_audit.h"
#include "train/trainer.h"

namespace moecore::train {

template <typename T>
std::vector<double> BasicTrainer<T>::score_sequences(
    const std::vector<std::vector<int32_t>>& seqs) {
  const int64_t S = model_cfg_.seq_length, B = cfg_.micro_batch;
  const int64_t n_global = n_micro_ * dp_size_;
  for (size_t i = 0; i < seqs.size(); ++i) {
    MOE_CHECK(static_cast<int64_t>(seqs[i].size()) <= S,
              "[eval] sequence {} has {} tokens, more than --seq-length {}", i, seqs[i].size(), S);
  }
  buckets_->wait_params();  // --overlap-param-gather: whole weights before any eval forward
  model_->set_training(false);
  std::vector<double> sums(seqs.size(), 0.0);
  // Whole sequences [B, S]: under CP split into this rank's chunks, else the staging itself.
  std::vector<int32_t> ids(static_cast<size_t>(B * S)), targets(ids.size());
  for (size_t first = 0; first < seqs.size(); first += static_cast<size_t>(n_global)) {
    {
      SyncAudit::Paused inputs;  // the host writes the inputs into its staging
      for (int64_t mb = 0; mb < n_micro_; ++mb) {
        // The global batch's micro-batch g (dp rank major, as the sample streams read it).
        const size_t g = first + static_cast<size_t>(dp_rank_ * n_micro_ + mb);
        int32_t* mb_ids = cp_split_.cp > 1 ? ids.data() : step_->ids(mb);
        int32_t* mb_targets = cp_split_.cp > 1 ? targets.data() : step_->targets(mb);
        std::fill(mb_ids, mb_ids + B * S, 0);
        std::fill(mb_targets, mb_targets + B * S, -1);  // ignored: a slot past the last sequence
        if (g < seqs.size()) {
          const std::vector<int32_t>& seq = seqs[g];
          const int64_t n = static_cast<int64_t>(seq.size());
          for (int64_t s = 0; s < n; ++s) mb_ids[s] = seq[s];
          for (int64_t s = 0; s + 1 < n; ++s) mb_targets[s] = seq[s + 1];
        }
        if (cp_split_.cp > 1) split_inputs(mb, ids.data(), targets.data());
        step_->dropout(mb) = ops::DropoutCounters{iteration_, static_cast<int64_t>(g) * B};
      }
    }
    step_->upload();
    runner_->forward_only(pipeline_hooks());
    step_->download();
    gather_micro_batch_values();  // every micro-batch's loss sum, on every rank
    for (int64_t g = 0; g < n_global && first + g < seqs.size(); ++g) {
      sums[first + g] = all_values_[g * mb_width_];
    }
  }
  model_->set_training(true);
  return sums;
}

template std::vector<double> BasicTrainer<float>::score_sequences(
    const std::vector<std::vector<int32_t>>&);
template std::vector<double> BasicTrainer<double>::score_sequences(
    const std::vector<std::vector<int32_t>>&);

}  // namespace moecore::train
