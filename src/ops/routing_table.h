// Routing replay's table copies: the top-k expert ids a MoE layer chose, copied between a rank's
// local [T, K] buffer and a global table keyed by (sample within the iteration's global batch,
// global sequence position), so that a run in one parallel layout records what a run in any other
// replays (each rank reads the rows of the tokens it routes). Pure copies: bitwise on every
// backend. Legend: K top-k, S the global sequence length, B micro-batch, T = rows * B tokens.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/dropout.h"

namespace moecore::ops {

// table: int32 [samples, S, K], S the global sequence length. A run of local rows: rows
// [0, rows) of local_TK (sequence-major: t = s * B + b, K columns per token) hold global
// positions pos0 + s (0 <= s < rows) of samples sample0 + b (0 <= b < B), sample0 read from
// counters->sample0 (DropoutCounters: device memory the host writes before the step, the index
// within the iteration's global batch of the micro-batch's first sample; DESIGN.md §8: per-step
// values come from buffers). local_TK's run starts at the
// pointer given: the caller offsets it by the run's first row (a sequence split in several runs,
// e.g. context parallelism's two chunks, is one call per run).
//   store: table[((sample0 + b) * S + pos0 + s) * K + k] = local_TK[(s * B + b) * K + k]
//   load:  local_TK[(s * B + b) * K + k] = table[((sample0 + b) * S + pos0 + s) * K + k]
// A token whose sample is outside [0, samples) or whose position is outside [0, S) is skipped by
// store and loads -1 (no expert): the device cannot throw, and the CPU paths do the same, so every
// backend gives the same bits. The shapes are checked on the host (samples, S, rows, B >= 0,
// K >= 1, counters set): each path throws naming them.
namespace cpu {  // the CPU fast paths (ops/cpu/): the switches below call them
void routing_table_store(int32_t* table, const int32_t* local_TK, const DropoutCounters* counters,
                         int64_t samples, int64_t S, int64_t rows, int64_t B, int64_t K,
                         int64_t pos0);
void routing_table_load(int32_t* local_TK, const int32_t* table, const DropoutCounters* counters,
                        int64_t samples, int64_t S, int64_t rows, int64_t B, int64_t K,
                        int64_t pos0);
}  // namespace cpu
// The CUDA kernels (ops/cuda/routing_table.cu); `stream` is the context's, `counters` device
// memory read inside the kernel. Bitwise the CPU's. The switches below call them where the build
// has kernels.
namespace cuda {
void routing_table_store(void* stream, int32_t* table, const int32_t* local_TK,
                         const DropoutCounters* counters, int64_t samples, int64_t S, int64_t rows,
                         int64_t B, int64_t K, int64_t pos0);
void routing_table_load(void* stream, int32_t* local_TK, const int32_t* table,
                        const DropoutCounters* counters, int64_t samples, int64_t S, int64_t rows,
                        int64_t B, int64_t K, int64_t pos0);
}  // namespace cuda

// Record: the run's rows into the table; entries of other tokens are left as they are.
inline void routing_table_store(const Exec& ex, DevPtr<int32_t> table,
                                DevPtr<const int32_t> local_TK,
                                DevPtr<const DropoutCounters> counters, int64_t samples, int64_t S,
                                int64_t rows, int64_t B, int64_t K, int64_t pos0) {
  if (ex.on_cpu())
    return cpu::routing_table_store(raw_ptr(table), raw_ptr(local_TK), raw_ptr(counters), samples,
                                    S, rows, B, K, pos0);
  return cuda::routing_table_store(ex.stream, raw_ptr(table), raw_ptr(local_TK), raw_ptr(counters),
                                   samples, S, rows, B, K, pos0);
}
void routing_table_store_ref(int32_t* table, const int32_t* local_TK,
                             const DropoutCounters* counters, int64_t samples, int64_t S,
                             int64_t rows, int64_t B, int64_t K, int64_t pos0);

// Replay: the run's rows from the table (-1 where the token falls outside it).
inline void routing_table_load(const Exec& ex, DevPtr<int32_t> local_TK,
                               DevPtr<const int32_t> table, DevPtr<const DropoutCounters> counters,
                               int64_t samples, int64_t S, int64_t rows, int64_t B, int64_t K,
                               int64_t pos0) {
  if (ex.on_cpu())
    return cpu::routing_table_load(raw_ptr(local_TK), raw_ptr(table), raw_ptr(counters), samples, S,
                                   rows, B, K, pos0);
  return cuda::routing_table_load(ex.stream, raw_ptr(local_TK), raw_ptr(table), raw_ptr(counters),
                                  samples, S, rows, B, K, pos0);
}
void routing_table_load_ref(int32_t* local_TK, const int32_t* table,
                            const DropoutCounters* counters, int64_t samples, int64_t S,
                            int64_t rows, int64_t B, int64_t K, int64_t pos0);

// The host-side checks of both ops and both CPU paths (throws naming the values and the fix).
void check_routing_table_args(const DropoutCounters* counters, int64_t samples, int64_t S,
                              int64_t rows, int64_t B, int64_t K, const char* op);

}  // namespace moecore::ops
