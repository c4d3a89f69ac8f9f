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

namespace {
// An empty plan that keeps its calls' capacity (the communicators reuse one per call: nothing
// allocates per collective once it has held the largest).
void reset(NcclPlan& p) {
  p.grouped = false;
  p.stage_bf16 = false;
  p.send_elems = p.recv_elems = 0;
  p.calls.clear();
}
}  // namespace

void nccl_all_reduce(NcclPlan& p, int64_t count, DType dt, NcclRedOp op) {
  MOE_CHECK(count >= 0, "[nccl_all_reduce] count {} must be >= 0", count);
  reset(p);
  p.send_elems = p.recv_elems = count;
  NcclCall c;
  c.kind = NcclKind::AllReduce;
  c.send = c.recv = {NcclBuf::Recv, 0};  // in place on data
  c.count = count;
  c.dtype = reduce_type(dt, p);
  c.op = op;
  if (count > 0) p.calls.push_back(c);
}

void nccl_all_gather_v(NcclPlan& p, int rank, std::span<const int64_t> counts, bool equal,
                       DType dt) {
  check_counts("nccl_all_gather_v", rank, counts);
  reset(p);
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
    return;
  }
  p.grouped = true;
  int64_t displ = 0;
  for (size_t r = 0; r < counts.size(); displ += counts[r], ++r) {
    if (counts[r] == 0) continue;
    p.calls.push_back({NcclKind::Broadcast, {NcclBuf::Send, 0}, {NcclBuf::Recv, displ},
                       counts[r], t, NcclRedOp::Sum, static_cast<int>(r)});
  }
}

void nccl_reduce_scatter_v(NcclPlan& p, int rank, std::span<const int64_t> counts, bool equal,
                           DType dt, NcclRedOp op) {
  check_counts("nccl_reduce_scatter_v", rank, counts);
  reset(p);
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
    return;
  }
  p.grouped = true;
  int64_t displ = 0;
  for (size_t r = 0; r < counts.size(); displ += counts[r], ++r) {
    if (counts[r] == 0) continue;
    p.calls.push_back({NcclKind::Reduce, {NcclBuf::Send, displ}, {NcclBuf::Recv, 0}, counts[r],
                       t, op, static_cast<int>(r)});
  }
}

void nccl_all_to_all_v(NcclPlan& p, int rank, std::span<const int64_t> send_counts,
                       std::span<const int64_t> recv_counts, DType dt) {
  check_counts("nccl_all_to_all_v send", rank, send_counts);
  check_counts("nccl_all_to_all_v recv", rank, recv_counts);
  MOE_CHECK(send_counts.size() == recv_counts.size(),
            "[nccl_all_to_all_v] {} send counts but {} recv counts: one each per rank",
            send_counts.size(), recv_counts.size());
  reset(p);
  p.grouped = true;
  p.send_elems = total_of(send_counts);
  p.recv_elems = total_of(recv_counts);
  const NcclDataType t = nccl_data_type(dt);
  int64_t sd = 0, rd = 0;
  for (size_t r = 0; r < send_counts.size(); sd += send_counts[r], rd += recv_counts[r], ++r) {
    if (send_counts[r] > 0)
      p.calls.push_back({NcclKind::Send, {NcclBuf::Send, sd}, {NcclBuf::Send, sd},
                         send_counts[r], t, NcclRedOp::Sum, static_cast<int>(r)});
    if (recv_counts[r] > 0)
      p.calls.push_back({NcclKind::Recv, {NcclBuf::Recv, rd}, {NcclBuf::Recv, rd},
                         recv_counts[r], t, NcclRedOp::Sum, static_cast<int>(r)});
  }
}

void nccl_broadcast(NcclPlan& p, int64_t count, DType dt, int root) {
  MOE_CHECK(count >= 0 && root >= 0, "[nccl_broadcast] count {} root {} must be >= 0", count,
            root);
  reset(p);
  p.send_elems = p.recv_elems = count;
  if (count > 0)
    p.calls.push_back({NcclKind::Broadcast, {NcclBuf::Recv, 0}, {NcclBuf::Recv, 0}, count,
                       nccl_data_type(dt), NcclRedOp::Sum, root});
}

NcclPlan nccl_all_reduce(int64_t count, DType dt, NcclRedOp op) {
  NcclPlan p;
  nccl_all_reduce(p, count, dt, op);
  return p;
}
NcclPlan nccl_all_gather_v(int rank, std::span<const int64_t> counts, bool equal, DType dt) {
  NcclPlan p;
  nccl_all_gather_v(p, rank, counts, equal, dt);
  return p;
}
NcclPlan nccl_reduce_scatter_v(int rank, std::span<const int64_t> counts, bool equal, DType dt,
                               NcclRedOp op) {
  NcclPlan p;
  nccl_reduce_scatter_v(p, rank, counts, equal, dt, op);
  return p;
}
NcclPlan nccl_all_to_all_v(int rank, std::span<const int64_t> send_counts,
                           std::span<const int64_t> recv_counts, DType dt) {
  NcclPlan p;
  nccl_all_to_all_v(p, rank, send_counts, recv_counts, dt);
  return p;
}
NcclPlan nccl_broadcast(int64_t count, DType dt, int root) {
  NcclPlan p;
  nccl_broadcast(p, count, dt, root);
  return p;
}

}  // namespace moecore::ops::desc
