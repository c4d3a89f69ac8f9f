// A layer's view of context parallelism: the attention grid's cp group (the sequence split over
// its ranks by parallel/context_split.h) and how attention reaches the other ranks' keys and
// values (--cp-comm-type). Passed to the attention layers like TensorParallel; the default is
// one rank, where attention is the single-rank op.
#pragma once

#include <cstdint>
#include <string>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "parallel/context_split.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

enum class CpCommType {
  P2P,        // ring: K/V pass around the cp ranks, partial results merged by log-sum-exp
  AllGather,  // K/V all-gathered, the local queries attend to the gathered sequence
};

// --cp-comm-type's value as the enum (p2p; allgather or all_gather); throws naming the flag for
// anything else (validate_layout refuses a2a and a2a+p2p first, with their own message).
CpCommType parse_cp_comm_type(const std::string& v);

class ContextParallel {
 public:
  ContextParallel() = default;  // one rank
  ContextParallel(const ProcessGroup* group, CpCommType type) : group_(group), type_(type) {}
  // The attention grid's cp group with decoder layer `layer`'s --cp-comm-type (null groups: one
  // rank). MTP depths (layer >= --num-layers) take the last layer's type.
  static ContextParallel attention(const ProcessGroups* groups, int64_t layer);

  int size() const { return group_ == nullptr ? 1 : group_->size(); }
  int rank() const { return group_ == nullptr ? 0 : group_->rank; }
  bool active() const { return size() > 1; }
  CpCommType type() const { return type_; }
  // The group's communicator of the context's memory (only when active()): every cp
  // collective moves device buffers (K / V blocks, the loss report).
  Communicator& communicator() const { return group_->device_communicator(); }
  // This rank's part of a sequence of S global positions.
  ContextSplit split(int64_t S) const { return ContextSplit{S, size(), rank()}; }

 private:
  const ProcessGroup* group_ = nullptr;
  CpCommType type_ = CpCommType::P2P;
};

// pos_T [S_local * B] <- the global position of each of this rank's rows (token t = s * B + b,
// s local): RoPE's angles and the learned position embedding's rows. With cp active, `whole`
// [cp * S_local * B] is scratch for the whole sequence's positions (null otherwise).
void global_positions(const Exec& ex, const ContextParallel& cp, DevPtr<int32_t> pos_T,
                      DevPtr<int32_t> whole, int64_t S_local, int64_t B);

}  // namespace moecore::parallel
