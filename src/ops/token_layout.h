// The data loader's batch-major token ids and targets [B, S] -> the model's sequence-major order
// t = s * B + b (Megatron's [S, B]), and the count of targets that count (>= 0; negative targets
// are ignored by the loss), written to `counted`; and the positions of the sequence-major tokens.
#pragma once

#include <cstdint>

#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void tokens_to_sequence_major(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S);
void sequence_positions(int32_t* pos_T, int64_t n_tok, int64_t B);
}  // namespace cpu

inline void tokens_to_sequence_major(const Exec& ex, int32_t* ids_T, int32_t* targets_T,
                                     int64_t* counted, const int32_t* ids_BS,
                                     const int32_t* targets_BS, int64_t B, int64_t S) {
  if (ex.on_cpu())
    return cpu::tokens_to_sequence_major(ids_T, targets_T, counted, ids_BS, targets_BS, B, S);
  no_kernel(ex, "tokens_to_sequence_major");
}
// pos [n_tok]: the position of token t = s * B + b in its sequence, s = t / B (RoPE's angles).
inline void sequence_positions(const Exec& ex, int32_t* pos_T, int64_t n_tok, int64_t B) {
  if (ex.on_cpu()) return cpu::sequence_positions(pos_T, n_tok, B);
  no_kernel(ex, "sequence_positions");
}
void sequence_positions_ref(int32_t* pos_T, int64_t n_tok, int64_t B);

void tokens_to_sequence_major_ref(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                                  const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                                  int64_t S);

}  // namespace moecore::ops
