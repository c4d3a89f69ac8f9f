// The micro-batch's context-parallel split (context_batch.h).
#include "train/context_batch.h"

namespace moecore::train {

void split_micro_batch(const parallel::ContextSplit& split, int64_t B, const int32_t* ids_BS,
                       const int32_t* targets_BS, int32_t* local_ids, int32_t* local_targets) {
  const int64_t S = split.S, S_loc = split.local_length();
  for (int64_t b = 0; b < B; ++b) {
    parallel::context_split_rows(split, ids_BS + b * S, 1, local_ids + b * S_loc);
    parallel::context_split_rows(split, targets_BS + b * S, 1, local_targets + b * S_loc);
  }
}

void roll_micro_batch(int64_t B, int64_t S, int64_t k, const int32_t* ids_BS,
                      const int32_t* targets_BS, int32_t* rolled_ids, int32_t* rolled_targets) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      const bool in = s + k < S;
      rolled_ids[b * S + s] = in ? ids_BS[b * S + s + k] : 0;
      rolled_targets[b * S + s] = in ? targets_BS[b * S + s + k] : -1;
    }
  }
}

}  // namespace moecore::train
