// Context parallelism's batch split (Megatron's get_batch_on_this_cp_rank): every rank of a cp
// group reads the same global samples, and keeps the load-balanced share of each sequence
// (parallel/context_split.h). Token ids and targets split alike; the loss mask travels inside
// the targets (< 0: not counted), so it splits with them; MTP's rolled ids and targets are rolled
// on the whole sequences first. Positions are not split here: the
// layers compute this rank's global positions from the same split (RoPE, learned positions,
// dropout).
#pragma once

#include <cstdint>

#include "parallel/context_split.h"

namespace moecore::train {

// ids_BS / targets_BS [B, S] (batch-major, the data loader's) -> local_ids / local_targets
// [B, S/cp]: sample b's positions of chunk r then of chunk 2 cp - 1 - r. With cp == 1 a copy.
// The split must have been checked (check_context_split).
void split_micro_batch(const parallel::ContextSplit& split, int64_t B, const int32_t* ids_BS,
                       const int32_t* targets_BS, int32_t* local_ids, int32_t* local_targets);

// Multi-token prediction depth k's inputs on the whole sequences, before the split (Megatron's
// roll_tensor(shifts=-k) of the ids, labels and loss mask): rolled_ids [b, s] = ids [b, s + k]
// and rolled_targets likewise while s + k < S; the last k positions take id 0 and target -1 (not
// counted). Split afterwards like the ids, so no rolled token crosses a CP rank's chunk
// boundary by communication. k >= 1.
void roll_micro_batch(int64_t B, int64_t S, int64_t k, const int32_t* ids_BS,
                      const int32_t* targets_BS, int32_t* rolled_ids, int32_t* rolled_targets);

}  // namespace moecore::train
