// The NCCL calls behind each Communicator collective (parallel/communicator.h): counts, offsets,
// datatypes, roots and peers, as pure functions of the collective's arguments, tested on the CPU
// against the Communicator's semantics through a plain-loop interpreter of NCCL's documented
// semantics (tests/common/nccl_interpreter.h). From the NCCL user guide
// (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/colls.html, usage/inplace.html,
// api/p2p.html):
// - all-reduce / broadcast / reduce are in place when sendbuff == recvbuff;
// - all-gather is in place when sendbuff == recvbuff + rank * sendcount, reduce-scatter when
//   recvbuff == sendbuff + rank * recvcount (the Communicator's in-place convention);
// - NCCL has no v-variants: uneven all-gather is a group of broadcasts (root r sends its
//   counts[r] elements into recv + displs[r]), uneven reduce-scatter a group of reduces (root r
//   gets the sum of every rank's piece send + displs[r]), all-to-all-v a group of sends and
//   receives; zero counts make no call (every rank knows every count, so both sides skip it).
// - bf16 reductions: NCCL reduces bf16 in bf16 (rounding every step); the Communicator reduces
//   in f32 and rounds once, so those plans run in f32 staging (stage_bf16).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "ops/desc/library_enums.h"

namespace moecore::ops::desc {

enum class NcclKind : uint8_t { AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, Send, Recv };

// A buffer address as an element offset from the collective's send or recv pointer (the
// Communicator's arguments; an in-place call's data is its recv).
enum class NcclBuf : uint8_t { Send, Recv };
struct NcclAddr {
  NcclBuf buf = NcclBuf::Send;
  int64_t off = 0;
};

// One NCCL call: ncclAllReduce(send, recv, count, ...), ncclAllGather(send, recv, sendcount),
// ncclReduceScatter(send, recv, recvcount), ncclBroadcast / ncclReduce(send, recv, count, root),
// ncclSend(send, count, peer), ncclRecv(recv, count, peer). `peer` is the root or the peer.
struct NcclCall {
  NcclKind kind = NcclKind::AllReduce;
  NcclAddr send, recv;
  int64_t count = 0;
  NcclDataType dtype = NcclDataType::Float32;
  NcclRedOp op = NcclRedOp::Sum;
  int peer = 0;
};

// The calls of one collective on one rank, between ncclGroupStart/End when `grouped`.
// stage_bf16: the collective's bf16 send is widened into f32 staging of send_elems elements,
// the calls address that staging (dtype Float32) and f32 staging of recv_elems for recv, and the
// result is rounded once into recv. send_elems / recv_elems: the extents the calls touch.
struct NcclPlan {
  bool grouped = false;
  bool stage_bf16 = false;
  int64_t send_elems = 0, recv_elems = 0;
  std::vector<NcclCall> calls;
};

NcclDataType nccl_data_type(DType dt);

// data (count elements, the recv buffer) = op over ranks.
NcclPlan nccl_all_reduce(int64_t count, DType dt, NcclRedOp op);
// recv = concat over ranks r of send_r (counts[r] elements); equal: all counts the same.
NcclPlan nccl_all_gather_v(int rank, std::span<const int64_t> counts, bool equal, DType dt);
// recv (counts[rank]) = op over ranks of their piece send + displs[rank]. In place when recv is
// send + displs[rank] (the calls are the same; NCCL sees the addresses).
NcclPlan nccl_reduce_scatter_v(int rank, std::span<const int64_t> counts, bool equal, DType dt,
                               NcclRedOp op);
// send holds send_counts[r] elements for rank r in order; recv gets recv_counts[r] from rank r.
NcclPlan nccl_all_to_all_v(int rank, std::span<const int64_t> send_counts,
                           std::span<const int64_t> recv_counts, DType dt);
// data (count elements, the recv buffer) = root's data.
NcclPlan nccl_broadcast(int64_t count, DType dt, int root);

// The same plans written into `plan` (cleared first, its calls' capacity kept): what the
// communicators call with one plan of their own, so that a collective inside a step allocates
// nothing once the plan has held the largest (--sync-audit).
void nccl_all_reduce(NcclPlan& plan, int64_t count, DType dt, NcclRedOp op);
void nccl_all_gather_v(NcclPlan& plan, int rank, std::span<const int64_t> counts, bool equal,
                       DType dt);
void nccl_reduce_scatter_v(NcclPlan& plan, int rank, std::span<const int64_t> counts, bool equal,
                           DType dt, NcclRedOp op);
void nccl_all_to_all_v(NcclPlan& plan, int rank, std::span<const int64_t> send_counts,
                       std::span<const int64_t> recv_counts, DType dt);
void nccl_broadcast(NcclPlan& plan, int64_t count, DType dt, int root);

}  // namespace moecore::ops::desc
