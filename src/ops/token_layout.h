// The data loader's batch-major token ids and targets [B, S] -> the model's sequence-major order
// t = s * B + b (Megatron's [S, B]), and the count of targets that count (>= 0; negative targets
// are ignored by the loss), written to `counted`.
#pragma once

#include <cstdint>

namespace moecore::ops {

void tokens_to_sequence_major(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S);
void tokens_to_sequence_major_ref(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                                  const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                                  int64_t S);

}  // namespace moecore::ops
