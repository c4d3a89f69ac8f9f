// The order in which one pipeline rank runs the forward and backward passes of its micro-batches:
// Megatron-Core's schedules (no pipelining, 1F1B, interleaved 1F1B over virtual stages) as pure
// functions of the degrees, so the trainer, the planner and the tests read one table.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moecore::pipeline {

enum class Pass : uint8_t { Forward, Backward };

// One step of a rank's schedule: a pass of micro-batch `microbatch` through its model chunk
// (virtual stage) `chunk`.
struct Work {
  Pass pass;
  int64_t microbatch;
  int chunk;
  bool operator==(const Work&) const = default;
};

struct ScheduleConfig {
  int pp = 1, rank = 0, vp = 1;
  int64_t num_microbatches = 1;
  int64_t group_size = 0;    // --microbatch-group-size-per-virtual-pipeline-stage; 0: pp
  bool forward_only = false; // eval: every forward, no backward
};

void validate_schedule(const ScheduleConfig& c);           // Megatron's errors, naming flags/values
std::vector<Work> schedule(const ScheduleConfig& c);        // this rank's order, Megatron's
int64_t warmup_forwards(const ScheduleConfig& c);
// Per chunk, the most micro-batches whose forward has run and backward has not, over the schedule
// (forward_only: 1): what the stage must keep in memory.
std::vector<int64_t> in_flight_per_chunk(const ScheduleConfig& c);
// Backwards not run right after the forward of the same (micro-batch, chunk): the forwards the
// pipeline runner recomputes from the kept input before them (it keeps one micro-batch's
// activations per chunk). 0 without pipelining and forward-only; the last stage of a plain 1F1B
// recomputes none.
int64_t recomputed_forwards(const ScheduleConfig& c);
std::string format_schedule(const ScheduleConfig& c);       // e.g. "F0.0 F1.0 B0.0 ..." (mb.chunk), for printing

// Megatron's get_schedule_table: the forward order as (micro-batch, chunk) pairs, every chunk
// running a group of `group_size` micro-batches in a row (the last group takes the rest). The
// k-th backward runs the same slot's micro-batch through chunk vp - 1 - chunk.
std::vector<std::pair<int64_t, int>> schedule_table(int64_t num_microbatches, int vp,
                                                    int64_t group_size);

}  // namespace moecore::pipeline
