// The data loader's batch-major token ids and targets [B, S] -> the model's sequence-major order
// t = s * B + b (Megatron's [S, B]), and the count of targets that count (>= 0; negative targets
// are ignored by the loss), written to `counted`.
#pragma once

#include <cstdint>

#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void tokens_to_sequence_major(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S);
}  // namespace cpu

inline void tokens_to_sequence_major(const Exec& ex, int32_t* ids_T, int32_t* targets_T,
                                     int64_t* counted, const int32_t* ids_BS,
                                     const int32_t* targets_BS, int64_t B, int64_t S) {
  if (ex.on_cpu())
    return cpu::tokens_to_sequence_major(ids_T, targets_T, counted, ids_BS, targets_BS, B, S);
  no_kernel(ex, "tokens_to_sequence_major");
}
void tokens_to_sequence_major_ref(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                                  const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                                  int64_t S);

}  // namespace moecore::ops
