// The interleaved schedule's point-to-point exchanges in lockstep rounds (Megatron-Core's
// p2p_communication._communicate under forward_backward_pipelining_with_interleaving: after each
// iteration, a forward, a forward and a backward, or a backward, one batched group that sends
// its outputs to both neighbours and receives what they send in the same round).
//
// Why rounds: NCCL has no tags (a pair's messages match in the order each side posts them) and
// runs a communicator's groups in order, each to its end. The pipeline ring (the last rank's
// chunk c feeds the first rank's chunk c + 1) closes a cycle, and receiving each message only
// when a step reads it leaves neighbours' groups waiting on each other (PP > 2, or groups larger
// than PP). Here every rank simulates all ranks alike (pure functions of the layout) in global
// rounds: in round t each rank sends the outputs of the iteration it ran in round t - 1 and
// receives, in the same group, exactly what its neighbours send it in round t (ahead of the
// step that reads it where that is later); then it runs its next iteration if all its inputs
// are in, else waits for a later round. So every group's partner operations lie in the peers'
// groups of the same round, and each rank's groups go in round order: by induction on the
// round, every group of round t starts once all of round t - 1 finished, and finishes. No wait
// cycle can form, whatever PP, VP, group size or micro-batch count.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "pipeline/schedule.h"

namespace moecore::pipeline {

// One round's group of rank c.rank (rounds where it neither sends nor receives are left out).
struct Round {
  size_t before = 0;          // the step it runs before (the schedule's length: after the last)
  // The steps whose outputs it sends (not the loss's forward, not the embedding's backward), in
  // step order (forward first).
  std::vector<size_t> sends;
  // What it receives, with the sender's pp rank: the previous rank's activation, then the next
  // rank's gradient (the order the sender posts them when both come from one rank, PP 2).
  std::vector<std::pair<Message, int>> recvs;
};

// Rank c.rank's rounds (c.vp > 1 and c.pp > 1; its schedule(c)).
std::vector<Round> lockstep_rounds(const ScheduleConfig& c);

// The steps' iterations as Megatron runs them: the warmup's forwards one each, then a forward
// and a backward together, then the cool-down's backwards one each (first step, step count).
std::vector<std::pair<size_t, size_t>> iterations(const ScheduleConfig& c);

}  // namespace moecore::pipeline
