#include "data/sample_stream.h"

#include "core/check.h"

namespace moecore::data {

SampleStream::SampleStream(const TokenSource* source, int64_t global_batch, int dp_size,
                           int dp_rank)
    : source_(source), global_batch_(global_batch), dp_size_(dp_size), dp_rank_(dp_rank) {
  MOE_CHECK(source != nullptr && global_batch > 0 && dp_size >= 1 && global_batch % dp_size == 0 &&
                dp_rank >= 0 && dp_rank < dp_size,
            "[data] sample stream: global batch {} over {} data-parallel ranks (rank {})",
            global_batch, dp_size, dp_rank);
}

void SampleStream::set_consumed_samples(int64_t n) {
  MOE_CHECK(n >= 0 && n % global_batch_ == 0,
            "[data] resuming at consumed samples {}: must be a multiple of the global batch {}",
            n, global_batch_);
  MOE_CHECK(source_->num_samples() < 0 || n <= source_->num_samples(),
            "[data] resuming at consumed samples {} beyond the {} samples of {}", n,
            source_->num_samples(), source_->describe());
  consumed_ = n;
}

void SampleStream::fill_micro_batch(int64_t mb, int64_t micro, int64_t S, int32_t* ids_BS,
                                    int32_t* targets_BS, int32_t* scratch_S1) const {
  const int64_t share = global_batch_ / dp_size_;
  MOE_CHECK((mb + 1) * micro <= share, "[data] micro-batch {} of {} samples beyond the share {}",
            mb, micro, share);
  const int64_t first = consumed_ + first_sample(mb, micro);
  make_batch(*source_, ids_BS, targets_BS, micro, S, static_cast<uint64_t>(first), scratch_S1);
  if (eod_mask_ >= 0) {
    for (int64_t i = 0; i < micro * S; ++i) {
      if (ids_BS[i] == eod_mask_) targets_BS[i] = -1;
    }
  }
}

}  // namespace moecore::data
