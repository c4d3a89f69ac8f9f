// A run's position in a token source: Megatron's consumed_samples. The global batch of each
// step is samples [consumed, consumed + global_batch) of the source in order, whatever the
// data-parallel size; data-parallel rank r takes the contiguous share
// [consumed + r * share, consumed + (r + 1) * share), share = global_batch / dp. A checkpoint
// saves consumed_samples() and a resumed run sets it back, so it continues the same stream.
#pragma once

#include <cstdint>

#include "data/token_source.h"

namespace moecore::data {

class SampleStream {
 public:
  SampleStream(const TokenSource* source, int64_t global_batch, int dp_size, int dp_rank);

  int64_t consumed_samples() const { return consumed_; }
  // Resumes at sample n (a multiple of the global batch, as Megatron's samplers require).
  void set_consumed_samples(int64_t n);
  // Fills micro-batch `mb` (of `micro` samples) of this rank's share of the current global
  // batch: ids / targets [micro, S] from samples of S + 1 tokens; scratch holds S + 1 tokens.
  void fill_micro_batch(int64_t mb, int64_t micro, int64_t S, int32_t* ids_BS, int32_t* targets_BS,
                        int32_t* scratch_S1) const;
  // The index within the current global batch of micro-batch mb's first sample.
  int64_t first_sample(int64_t mb, int64_t micro) const {
    return dp_rank_ * (global_batch_ / dp_size_) + mb * micro;
  }
  // --eod-mask-loss: targets at positions whose input token is `eod` are ignored (-1).
  void set_eod_mask(int64_t eod) { eod_mask_ = eod; }
  // The global batch has been consumed.
  void advance() { consumed_ += global_batch_; }
  const TokenSource& source() const { return *source_; }

 private:
  const TokenSource* source_;
  int64_t global_batch_;
  int dp_size_, dp_rank_;
  int64_t consumed_ = 0;
  int64_t eod_mask_ = -1;  // -1: no masking
};

}  // namespace moecore::data
