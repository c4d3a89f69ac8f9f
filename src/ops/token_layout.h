// The data loader's batch-major token ids and targets [B, S] -> the model's sequence-major order
// t = s * B + b (Megatron's [S, B]), and the count of targets that count (>= 0; negative targets
// are ignored by the loss), written to `counted`; the positions of the sequence-major tokens; and
// multi-token prediction's roll of them (Megatron's roll_tensor) k positions ahead.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
void tokens_to_sequence_major(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S);
void sequence_positions(int32_t* pos_T, int64_t n_tok, int64_t B);
void roll_tokens(int32_t* out_T, int64_t* counted, const int32_t* in_T, int64_t n_tok,
                 int64_t shift, int32_t fill);
}  // namespace cpu
// The CUDA kernels (ops/cuda/token_layout.cu): bitwise the CPU's (the count is an integer sum);
// `stream` is the context's.
namespace cuda {
void tokens_to_sequence_major(void* stream, int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                              const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                              int64_t S);
void sequence_positions(void* stream, int32_t* pos_T, int64_t n_tok, int64_t B);
void roll_tokens(void* stream, int32_t* out_T, int64_t* counted, const int32_t* in_T, int64_t n_tok,
                 int64_t shift, int32_t fill);
}  // namespace cuda

inline void tokens_to_sequence_major(const Exec& ex, DevPtr<int32_t> ids_T,
                                     DevPtr<int32_t> targets_T, DevPtr<int64_t> counted,
                                     DevPtr<const int32_t> ids_BS, DevPtr<const int32_t> targets_BS,
                                     int64_t B, int64_t S) {
  if (ex.on_cpu())
    return cpu::tokens_to_sequence_major(raw_ptr(ids_T), raw_ptr(targets_T), raw_ptr(counted),
                                         raw_ptr(ids_BS), raw_ptr(targets_BS), B, S);
  return cuda::tokens_to_sequence_major(ex.stream, raw_ptr(ids_T), raw_ptr(targets_T),
                                        raw_ptr(counted), raw_ptr(ids_BS), raw_ptr(targets_BS), B,
                                        S);
}
// pos [n_tok]: the position of token t = s * B + b in its sequence, s = t / B (RoPE's angles).
inline void sequence_positions(const Exec& ex, DevPtr<int32_t> pos_T, int64_t n_tok, int64_t B) {
  if (ex.on_cpu()) return cpu::sequence_positions(raw_ptr(pos_T), n_tok, B);
  return cuda::sequence_positions(ex.stream, raw_ptr(pos_T), n_tok, B);
}
void sequence_positions_ref(int32_t* pos_T, int64_t n_tok, int64_t B);

// Megatron's roll_tensor(shifts=-k) on sequence-major tokens (multi-token prediction's ids,
// positions and targets at depth k): out[t] = in[t + shift] while t + shift < n_tok, else `fill`,
// with shift = k * B, so that position s of every sequence takes position s + k's value and the
// last k positions take `fill` (Megatron's 0; -1 for targets: the vacated positions do not
// count). counted (null: not wanted): the outputs >= 0, the targets that count. shift >= 0.
inline void roll_tokens(const Exec& ex, DevPtr<int32_t> out_T, DevPtr<int64_t> counted,
                        DevPtr<const int32_t> in_T, int64_t n_tok, int64_t shift, int32_t fill) {
  if (ex.on_cpu())
    return cpu::roll_tokens(raw_ptr(out_T), raw_ptr(counted), raw_ptr(in_T), n_tok, shift, fill);
  return cuda::roll_tokens(ex.stream, raw_ptr(out_T), raw_ptr(counted), raw_ptr(in_T), n_tok, shift,
                           fill);
}
void roll_tokens_ref(int32_t* out_T, int64_t* counted, const int32_t* in_T, int64_t n_tok,
                     int64_t shift, int32_t fill);

void tokens_to_sequence_major_ref(int32_t* ids_T, int32_t* targets_T, int64_t* counted,
                                  const int32_t* ids_BS, const int32_t* targets_BS, int64_t B,
                                  int64_t S);

}  // namespace moecore::ops
