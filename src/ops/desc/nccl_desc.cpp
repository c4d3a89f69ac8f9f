// NCCL call plans of the Communicator's collectives (nccl_desc.h).
#include "ops/desc/nccl_desc.h"

#include "core/check.h"

namespace moecore::ops::desc {

namespace {

void check_counts(const char* who, int rank, std::span<const int64_t> counts) {
  MOE_CHECK(!counts.empty() && rank >= 0 && rank < static_cast<int>(counts.size()),
            "[{}] rank {} outside a group of {} counts", who, rank, counts.size());
  for (size_t r = 0; r < counts.size(); ++r)
    MOE_CHECK(counts[r] >= 0, "[{}] count {} of rank {} must be >= 0", who, counts[r], r);
}

std::vector<int64_t> displs_of(std::span<const int64_t> counts) {
  std::vector<int64_t> d(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) d[r] = d[r - 1] + counts[r - 1];
  return d;
}

int64_t total_of(std::span<const int64_t> counts) {
  int64_t t = 0;
  for (int64_t c : counts) t += c;
  return t;
}

// Reductions of bf16 run in f32 staging (nccl_desc.h).
NcclDataType reduce_type(DType dt, NcclPlan& plan) {
  if (dt != DType::BF16) return nccl_data_type(dt);
  plan.stage_bf16 = true;
  return NcclDataType::Float32;
}

}  // namespace

NcclDataType nccl_data_type(DType dt) {
  switch (dt) {
    case DType::F32: return NcclDataType::Float32;
    case DType::BF16: return NcclDataType::Bfloat16;
    case DType::F64: return NcclDataType::Float64;
    case DType::I32: return NcclDataType::Int32;
    case DType::I64: return NcclDataType::Int64;
  }
  MOE_CHECK(false, "[nccl_desc] unknown dtype {}", static_cast<int>(dt));
  return NcclDataType::Float32;
}

NcclPlan nccl_all_reduce(int64_t count, DType dt, NcclRedOp op) {
  MOE_CHECK(count >= 0, "[nccl_all_reduce] count {} must be >= 0", count);
  NcclPlan p;
  p.send_elems = p.recv_elems = count;
  NcclCall c;
  c.kind = NcclKind::AllReduce;
  c.send = c.recv = {NcclBuf::Recv, 0};  // in place on data
  c.count = count;
  c.dtype = reduce_type(dt, p);
  c.op = op;
  if (count > 0) p.calls.push_back(c);
  return p;
}

NcclPlan nccl_all_gather_v(int rank, std::span<const int64_t> counts, bool equal, DType dt) {
  check_counts("nccl_all_gather_v", rank, counts);
  NcclPlan p;
  p.send_elems = counts[rank];
  p.recv_elems = total_of(counts);
  const NcclDataType t = nccl_data_type(dt);
  if (equal) {
    for (int64_t c : counts)
      MOE_CHECK(c == counts[0], "[nccl_all_gather] equal counts expected, got {} and {}", counts[0],
                c);
    if (counts[0] > 0)
      p.calls.push_back({NcclKind::AllGather, {NcclBuf::Send, 0}, {NcclBuf::Recv, 0}, counts[0], t,
                         NcclRedOp::Sum, 0});
    return p;
  }
  p.grouped = true;
  const std::vector<int64_t> displs = displs_of(counts);
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] == 0) continue;
    p.calls.push_back({NcclKind::Broadcast, {NcclBuf::Send, 0}, {NcclBuf::Recv, displs[r]},
                       counts[r], t, NcclRedOp::Sum, static_cast<int>(r)});
  }
  return p;
}

NcclPlan nccl_reduce_scatter_v(int rank, std::span<const int64_t> counts, bool equal, DType dt,
                               NcclRedOp op) {
  check_counts("nccl_reduce_scatter_v", rank, counts);
  NcclPlan p;
  p.send_elems = total_of(counts);
  p.recv_elems = counts[rank];
  const NcclDataType t = reduce_type(dt, p);
  if (equal) {
    for (int64_t c : counts)
      MOE_CHECK(c == counts[0], "[nccl_reduce_scatter] equal counts expected, got {} and {}",
                counts[0], c);
    if (counts[0] > 0)
      p.calls.push_back({NcclKind::ReduceScatter, {NcclBuf::Send, 0}, {NcclBuf::Recv, 0}, counts[0],
                         t, op, 0});
    return p;
  }
  p.grouped = true;
  const std::vector<int64_t> displs = displs_of(counts);
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] == 0) continue;
    p.calls.push_back({NcclKind::Reduce, {NcclBuf::Send, displs[r]}, {NcclBuf::Recv, 0}, counts[r],
                       t, op, static_cast<int>(r)});
  }
  return p;
}

NcclPlan nccl_all_to_all_v(int rank, std::span<const int64_t> send_counts,
                           std::span<const int64_t> recv_counts, DType dt) {
  check_counts("nccl_all_to_all_v send", rank, send_counts);
  check_counts("nccl_all_to_all_v recv", rank, recv_counts);
  MOE_CHECK(send_counts.size() == recv_counts.size(),
            "[nccl_all_to_all_v] {} send counts but {} recv counts: one each per rank",
            send_counts.size(), recv_counts.size());
  NcclPlan p;
  p.grouped = true;
  p.send_elems = total_of(send_counts);
  p.recv_elems = total_of(recv_counts);
  const NcclDataType t = nccl_data_type(dt);
  const std::vector<int64_t> sd = displs_of(send_counts), rd = displs_of(recv_counts);
  for (size_t r = 0; r < send_counts.size(); ++r) {
    if (send_counts[r] > 0)
      p.calls.push_back({NcclKind::Send, {NcclBuf::Send, sd[r]}, {NcclBuf::Send, sd[r]},
                         send_counts[r], t, NcclRedOp::Sum, static_cast<int>(r)});
    if (recv_counts[r] > 0)
      p.calls.push_back({NcclKind::Recv, {NcclBuf::Recv, rd[r]}, {NcclBuf::Recv, rd[r]},
                         recv_counts[r], t, NcclRedOp::Sum, static_cast<int>(r)});
  }
  return p;
}

NcclPlan nccl_broadcast(int64_t count, DType dt, int root) {
  MOE_CHECK(count >= 0 && root >= 0, "[nccl_broadcast] count {} root {} must be >= 0", count,
            root);
  NcclPlan p;
  p.send_elems = p.recv_elems = count;
  if (count > 0)
    p.calls.push_back({NcclKind::Broadcast, {NcclBuf::Recv, 0}, {NcclBuf::Recv, 0}, count,
                       nccl_data_type(dt), NcclRedOp::Sum, root});
  return p;
}

}  // namespace moecore::ops::desc
