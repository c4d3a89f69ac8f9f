// Routing replay's table copies (moe/routing_replay.h): the top-k expert ids a MoE layer chose,
// copied between a rank's local [T, K] buffer and the micro-batch's table of that layer, keyed by
// (sample of the micro-batch, global sequence position), so that a run in one parallel layout
// records what a run in any other replays (each rank reads and writes the rows of the tokens it
// routes; the trainer places the micro-batch's samples in the global batch). Pure copies: bitwise
// on every backend. Legend: K top-k, S the global sequence length, B the micro-batch's samples,
// T = rows * B tokens of a run.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

// table_BSK: int32 [B, S, K]. A run of local rows: rows [0, rows) of local_TK (sequence-major:
// t = s * B + b, K ids per token) hold global positions pos0 + s (0 <= s < rows) of the
// micro-batch's samples b (0 <= b < B). local_TK's run starts at the pointer given: the caller
// offsets it by the run's first row (a sequence split in several runs, e.g. context
// parallelism's two chunks, is one call per run).
//   store: table_BSK[(b * S + pos0 + s) * K + k] = local_TK[(s * B + b) * K + k]
//   load:  local_TK[(s * B + b) * K + k] = table_BSK[(b * S + pos0 + s) * K + k]
// A token whose position is outside [0, S) is skipped by store and loads -1 (no expert): the
// device cannot throw, and the CPU paths do the same, so every backend gives the same bits. The
// shapes are checked on the host (S, rows, B >= 0, K >= 1, B S K and rows B K below 2^31): each
// path throws naming them.
namespace cpu {  // the CPU fast paths (ops/cpu/): the switches below call them
void routing_table_store(int32_t* table_BSK, const int32_t* local_TK, int64_t B, int64_t S,
                         int64_t K, int64_t rows, int64_t pos0);
void routing_table_load(int32_t* local_TK, const int32_t* table_BSK, int64_t B, int64_t S,
                        int64_t K, int64_t rows, int64_t pos0);
}  // namespace cpu
// The CUDA kernels (ops/cuda/routing_table.cu); `stream` is the context's. Bitwise the CPU's.
// The switches below call them where the build has kernels.
namespace cuda {
void routing_table_store(void* stream, int32_t* table_BSK, const int32_t* local_TK, int64_t B,
                         int64_t S, int64_t K, int64_t rows, int64_t pos0);
void routing_table_load(void* stream, int32_t* local_TK, const int32_t* table_BSK, int64_t B,
                        int64_t S, int64_t K, int64_t rows, int64_t pos0);
}  // namespace cuda

// Record: the run's rows into the table; entries of other tokens are left as they are.
inline void routing_table_store(const Exec& ex, DevPtr<int32_t> table_BSK,
                                DevPtr<const int32_t> local_TK, int64_t B, int64_t S, int64_t K,
                                int64_t rows, int64_t pos0) {
  if (ex.on_cpu())
    return cpu::routing_table_store(raw_ptr(table_BSK), raw_ptr(local_TK), B, S, K, rows, pos0);
  return cuda::routing_table_store(ex.stream, raw_ptr(table_BSK), raw_ptr(local_TK), B, S, K,
                                   rows, pos0);
}
void routing_table_store_ref(int32_t* table_BSK, const int32_t* local_TK, int64_t B, int64_t S,
                             int64_t K, int64_t rows, int64_t pos0);

// Replay: the run's rows from the table (-1 where a position falls outside it).
inline void routing_table_load(const Exec& ex, DevPtr<int32_t> local_TK,
                               DevPtr<const int32_t> table_BSK, int64_t B, int64_t S, int64_t K,
                               int64_t rows, int64_t pos0) {
  if (ex.on_cpu())
    return cpu::routing_table_load(raw_ptr(local_TK), raw_ptr(table_BSK), B, S, K, rows, pos0);
  return cuda::routing_table_load(ex.stream, raw_ptr(local_TK), raw_ptr(table_BSK), B, S, K, rows,
                                  pos0);
}
void routing_table_load_ref(int32_t* local_TK, const int32_t* table_BSK, int64_t B, int64_t S,
                            int64_t K, int64_t rows, int64_t pos0);

// The host-side checks of both ops and both CPU paths (throws naming the values and the fix).
void check_routing_table_args(int64_t B, int64_t S, int64_t K, int64_t rows, const char* op);

}  // namespace moecore::ops
