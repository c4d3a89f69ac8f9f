// The order in which one pipeline rank runs the forward and backward passes of its micro-batches:
// Megatron-Core's schedules (no pipelining, 1F1B, interleaved 1F1B over virtual stages) as pure
// functions of the degrees, so the trainer, the planner and the tests read one table; and the
// messages between the ranks that follow from them, with the order each rank posts its receives.
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

// A message between pipeline ranks: micro-batch `microbatch`'s activation entering the receiver's
// chunk `chunk` (a forward's output), or the gradient of that chunk's output (a backward's input
// gradient, sent back). The first virtual stage (rank 0, chunk 0: the embedding) receives no
// activation and sends no gradient; the last (rank pp - 1, chunk vp - 1: the loss) sends no
// activation and receives no gradient.
struct Message {
  bool gradient = false;
  int64_t microbatch = 0;
  int chunk = 0;  // the receiver's
  bool operator==(const Message&) const = default;
};

// What rank `sender` sends rank `receiver` (c.rank is ignored), in the order it posts the sends:
// its schedule's, each forward's activation as the forward ends, each backward's input gradient
// as the backward ends.
std::vector<Message> messages_sent(const ScheduleConfig& c, int sender, int receiver);

// Where rank c.rank receives its messages, and when it posts the receives. NCCL has no tags: a
// pair's messages match in the order both sides post them, and a communicator's groups run in
// order, each to its end.
// - 1F1B (vp 1): every receive is posted in its sender's order (messages_sent), before the step
//   that reads it (and every earlier one of the same sender not yet posted), and waited there;
//   the sends of the steps before go in the same group. The stages form a chain, each group
//   pairs with its neighbour's.
// - The interleaved schedule (vp > 1): the lockstep rounds of pipeline/lockstep.h, Megatron's
//   batched exchanges: after each iteration one group sends its outputs and receives what the
//   neighbours send in the same round (ahead of the step that reads it where that is later), and
//   is waited whole (`exchanges`). Every group's partners lie in the peers' groups of the same
//   round: no two groups can wait on each other (the ring of the virtual stages included).
// Activations land in a stash slot of their chunk, kept until the backward (forward-only: until
// the forward ends), gradients in a gradient slot until the backward reads them; each takes the
// lowest free slot.
struct RecvPost {
  Message msg;
  int peer = 0;  // pp rank of the sender
  int slot = 0;  // a stash slot of msg.chunk, or a gradient slot
};
// One group of the interleaved schedule's exchanges, issued and waited whole.
struct Exchange {
  size_t before = 0;                    // the step it precedes (the schedule's length: the end)
  std::vector<size_t> sends;            // the steps whose outputs it sends, in step order
  size_t first_post = 0, end_post = 0;  // its receives: posts[first_post, end_post)
};
struct RecvPlan {
  std::vector<RecvPost> posts;  // in posting order
  std::vector<size_t> first;    // step i posts posts[first[i] .. first[i + 1]) before it runs
  // Per step: the stash slot of the chunk's input (-1: the embedding's chunk, or no pipelining)
  // and, for a backward, the gradient slot of its output gradient (-1: the loss's chunk).
  std::vector<int> input_slot, grad_slot;
  // vp > 1: the groups in order (every receive belongs to one; each step's outputs are sent by
  // the first one after it). Empty for vp 1.
  std::vector<Exchange> exchanges;
  std::vector<int64_t> stash_slots;  // per chunk: the most activations held at once
  int64_t grad_slots = 0;            // the most gradients held at once
};
// The plan of rank c.rank's schedule(c) (pp 1: nothing received).
RecvPlan recv_plan(const ScheduleConfig& c);

}  // namespace moecore::pipeline
