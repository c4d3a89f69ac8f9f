// The NCCL communicators' point-to-point batch (the real one, communicator_nccl_cuda.cpp, and the
// emulated one, tests/emu/device/communicator_nccl_emu.cpp). On a GPU an ungrouped ncclSend
// blocks its stream until the peer posts the matching receive, and a communicator's stream runs
// its operations in order: a rank that sends to one peer and then receives from another, while
// that peer does the same (the context-parallel ring, the pipeline's exchanges), waits for ever.
// So send_async / recv_async are not issued when called but collected here, and the batch goes
// out as one NCCL group (ncclGroupStart / ncclGroupEnd, as Megatron's batch_isend_irecv does)
// when the communicator's next other collective starts or when any of its handles is waited or
// tested. Each point-to-point handle completes with its group. The batch's storage is kept
// (nothing allocates per call once it has held the most operations ever collected at once).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "ops/desc/nccl_desc.h"

namespace moecore::parallel {

template <class Request>
class NcclP2pBatch {
 public:
  struct Op {
    ops::desc::NcclKind kind;  // Send or Recv
    const void* send;          // Send: the data
    void* recv;                // Recv: the data
    int64_t count;
    DType dt;
    int peer;
    Request* req;  // the handle's request, completed with the group
  };

  void add(const Op& op) { ops_.push_back(op); }
  bool empty() const { return ops_.empty(); }
  // A request given up before its group was issued (its handle failed) leaves the batch.
  void forget(const Request* r) {
    std::erase_if(ops_, [r](const Op& o) { return o.req == r; });
  }
  // Hands the collected operations, in posting order, to issue(span<const Op>) as one group,
  // then empties the batch (its capacity kept). Nothing to issue: issue is not called.
  template <class Issue>
  void issue(Issue&& issue_group) {
    if (ops_.empty()) return;
    issue_group(std::span<const Op>(ops_));
    ops_.clear();
  }

 private:
  std::vector<Op> ops_;
};

}  // namespace moecore::parallel
