// Test-only plain-loop interpreter of NCCL's documented semantics
// (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/colls.html, api/p2p.html,
// usage/inplace.html, usage/groups.html) over R simulated ranks, each with one memory holding
// the collective's send and recv buffers (they may alias: in-place calls). It runs one
// descriptor plan per rank (ops/desc/nccl_desc.h) and checks what NCCL requires or leaves
// undefined: every rank issues the same collectives in the same order with the same count,
// type, op and root; sends and receives pair up with equal counts; every access stays inside
// its buffer; an operation's send and recv overlap only in NCCL's in-place forms; the
// operations of one group neither write the same bytes nor write what another reads. All reads
// see the memory as it was before the plan (a group's operations are concurrent).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ops/desc/nccl_desc.h"

namespace moecore::testing {

struct SimRank {
  std::vector<uint8_t> mem;
  int64_t send_at = 0, send_len = 0;  // bytes offset, elements
  int64_t recv_at = 0, recv_len = 0;
};

namespace nccl_sim {

using ops::desc::NcclBuf;
using ops::desc::NcclCall;
using ops::desc::NcclDataType;
using ops::desc::NcclKind;
using ops::desc::NcclPlan;
using ops::desc::NcclRedOp;

inline size_t elem_size(NcclDataType t) {
  switch (t) {
    case NcclDataType::Int32: case NcclDataType::Float32: return 4;
    case NcclDataType::Int64: case NcclDataType::Float64: return 8;
    case NcclDataType::Bfloat16: return 2;
  }
  return 0;
}

inline double load(NcclDataType t, const uint8_t* p) {
  switch (t) {
    case NcclDataType::Int32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case NcclDataType::Int64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    case NcclDataType::Float32: { float v; std::memcpy(&v, p, 4); return v; }
    case NcclDataType::Float64: { double v; std::memcpy(&v, p, 8); return v; }
    case NcclDataType::Bfloat16: { bf16 v; std::memcpy(&v, p, 2); return bf16_to_float(v); }
  }
  return 0;
}

inline void store(NcclDataType t, uint8_t* p, double x) {
  switch (t) {
    case NcclDataType::Int32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p, &v, 4); return; }
    case NcclDataType::Int64: { int64_t v = static_cast<int64_t>(x); std::memcpy(p, &v, 8); return; }
    case NcclDataType::Float32: { float v = static_cast<float>(x); std::memcpy(p, &v, 4); return; }
    case NcclDataType::Float64: std::memcpy(p, &x, 8); return;
    case NcclDataType::Bfloat16: { bf16 v = float_to_bf16(static_cast<float>(x)); std::memcpy(p, &v, 2); return; }
  }
}

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error("[nccl sim] " + what); }

struct Range {
  int64_t lo = 0, hi = 0;  // bytes [lo, hi)
  bool overlaps(const Range& o) const { return lo < o.hi && o.lo < hi && lo < hi && o.lo < o.hi; }
};

struct Access {
  int op = 0;
  Range r;
  bool write = false;
};

// The byte range of count elements at a, checked against its buffer.
inline Range at(const SimRank& m, ops::desc::NcclAddr a, int64_t count, size_t es, int rank) {
  const bool send = a.buf == NcclBuf::Send;
  const int64_t base = send ? m.send_at : m.recv_at, len = send ? m.send_len : m.recv_len;
  if (a.off < 0 || a.off + count > len)
    fail("rank " + std::to_string(rank) + ": elements [" + std::to_string(a.off) + ", " +
         std::to_string(a.off + count) + ") outside its " + (send ? "send" : "recv") +
         " buffer of " + std::to_string(len));
  return {base + a.off * static_cast<int64_t>(es), base + (a.off + count) * static_cast<int64_t>(es)};
}

inline double reduce(NcclRedOp op, double a, double b) { return op == NcclRedOp::Sum ? a + b : std::max(a, b); }

inline void run_direct(const std::vector<NcclPlan>& plans, std::vector<SimRank>& ranks) {
  const int R = static_cast<int>(ranks.size());
  std::vector<std::vector<uint8_t>> snap(R);
  for (int r = 0; r < R; ++r) snap[r] = ranks[r].mem;
  std::vector<std::vector<Access>> acc(R);
  auto record = [&](int rank, int op, Range rg, bool write) { acc[rank].push_back({op, rg, write}); };
  std::vector<std::vector<const NcclCall*>> coll(R);
  for (int r = 0; r < R; ++r) {
    if (plans[r].grouped != plans[0].grouped) fail("ranks disagree on grouping");
    for (const NcclCall& c : plans[r].calls)
      if (c.kind != NcclKind::Send && c.kind != NcclKind::Recv) coll[r].push_back(&c);
  }
  for (int r = 1; r < R; ++r)
    if (coll[r].size() != coll[0].size()) fail("ranks issue different numbers of collectives: NCCL hangs");
  // Collectives, matched by order.
  for (size_t i = 0; i < coll[0].size(); ++i) {
    const NcclCall& c0 = *coll[0][i];
    for (int r = 1; r < R; ++r) {
      const NcclCall& c = *coll[r][i];
      if (c.kind != c0.kind || c.count != c0.count || c.dtype != c0.dtype || c.op != c0.op ||
          c.peer != c0.peer)
        fail("collective " + std::to_string(i) + " differs between rank 0 and rank " + std::to_string(r));
    }
    const size_t es = elem_size(c0.dtype);
    const int64_t n = c0.count;
    const int op_id = static_cast<int>(i);
    std::vector<Range> s(R), d(R);
    for (int r = 0; r < R; ++r) {
      const NcclCall& c = *coll[r][i];
      const int64_t send_n = c0.kind == NcclKind::ReduceScatter ? n * R : n;
      const int64_t recv_n = c0.kind == NcclKind::AllGather ? n * R : n;
      const bool reads = !((c0.kind == NcclKind::Broadcast) && r != c0.peer);
      const bool writes = !((c0.kind == NcclKind::Reduce) && r != c0.peer);
      if (reads) s[r] = at(ranks[r], c.send, send_n, es, r);
      if (writes) d[r] = at(ranks[r], c.recv, recv_n, es, r);
      // NCCL's in-place forms; any other overlap of one operation's buffers is undefined.
      if (reads && writes && s[r].overlaps(d[r])) {
        bool in_place = false;
        const int64_t off = static_cast<int64_t>(r) * n * static_cast<int64_t>(es);
        switch (c0.kind) {
          case NcclKind::AllGather: in_place = s[r].lo == d[r].lo + off; break;
          case NcclKind::ReduceScatter: in_place = d[r].lo == s[r].lo + off; break;
          default: in_place = s[r].lo == d[r].lo; break;
        }
        if (!in_place) fail("rank " + std::to_string(r) + ": send and recv overlap outside NCCL's in-place form");
      } else {
        if (reads) record(r, op_id, s[r], false);
        if (writes) record(r, op_id, d[r], true);
        continue;
      }
      record(r, op_id, d[r], true);  // in place: its own read is its write
    }
    auto src = [&](int q, int64_t e) { return load(c0.dtype, snap[q].data() + s[q].lo + e * es); };
    auto dst = [&](int r, int64_t e, double v) { store(c0.dtype, ranks[r].mem.data() + d[r].lo + e * es, v); };
    for (int r = 0; r < R; ++r) {
      switch (c0.kind) {
        case NcclKind::AllReduce:
          for (int64_t e = 0; e < n; ++e) {
            double v = src(0, e);
            for (int q = 1; q < R; ++q) v = reduce(c0.op, v, src(q, e));
            dst(r, e, v);
          }
          break;
        case NcclKind::AllGather:
          for (int q = 0; q < R; ++q)
            for (int64_t e = 0; e < n; ++e) dst(r, q * n + e, src(q, e));
          break;
        case NcclKind::ReduceScatter:
          for (int64_t e = 0; e < n; ++e) {
            double v = src(0, r * n + e);
            for (int q = 1; q < R; ++q) v = reduce(c0.op, v, src(q, r * n + e));
            dst(r, e, v);
          }
          break;
        case NcclKind::Broadcast:
          for (int64_t e = 0; e < n; ++e) dst(r, e, src(c0.peer, e));
          break;
        case NcclKind::Reduce:
          if (r != c0.peer) break;
          for (int64_t e = 0; e < n; ++e) {
            double v = src(0, e);
            for (int q = 1; q < R; ++q) v = reduce(c0.op, v, src(q, e));
            dst(r, e, v);
          }
          break;
        default: break;
      }
    }
  }
  // Point to point: the k-th send from r to p pairs with the k-th receive on p from r.
  int op_id = 1000;
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < R; ++p) {
      std::vector<const NcclCall*> sends, recvs;
      for (const NcclCall& c : plans[r].calls)
        if (c.kind == NcclKind::Send && c.peer == p) sends.push_back(&c);
      for (const NcclCall& c : plans[p].calls)
        if (c.kind == NcclKind::Recv && c.peer == r) recvs.push_back(&c);
      if (sends.size() != recvs.size())
        fail(std::to_string(sends.size()) + " sends from rank " + std::to_string(r) + " to " +
             std::to_string(p) + " but " + std::to_string(recvs.size()) + " receives: NCCL hangs");
      if (!sends.empty() && !plans[r].grouped) fail("send/recv outside a group can deadlock");
      for (size_t k = 0; k < sends.size(); ++k) {
        if (sends[k]->count != recvs[k]->count || sends[k]->dtype != recvs[k]->dtype)
          fail("send " + std::to_string(sends[k]->count) + " elements from rank " + std::to_string(r) +
               " to " + std::to_string(p) + ", receive " + std::to_string(recvs[k]->count));
        const size_t es = elem_size(sends[k]->dtype);
        const Range s = at(ranks[r], sends[k]->send, sends[k]->count, es, r);
        const Range d = at(ranks[p], recvs[k]->recv, recvs[k]->count, es, p);
        record(r, op_id, s, false);
        record(p, op_id + 1, d, true);
        op_id += 2;
        std::memcpy(ranks[p].mem.data() + d.lo, snap[r].data() + s.lo, d.hi - d.lo);
      }
    }
  }
  // Concurrent operations must not race.
  for (int r = 0; r < R; ++r)
    for (const Access& a : acc[r])
      for (const Access& b : acc[r])
        if (a.op != b.op && a.write && a.r.overlaps(b.r))
          fail("rank " + std::to_string(r) + ": an operation writes bytes another one " +
               (b.write ? "writes" : "reads"));
}

}  // namespace nccl_sim

// Runs one collective: plans[r] on rank r. A bf16-staged plan runs in f32 staging (the send
// widened, the result rounded once into recv), as the backend does.
inline void nccl_run(const std::vector<ops::desc::NcclPlan>& plans, std::vector<SimRank>& ranks) {
  if (plans.size() != ranks.size()) nccl_sim::fail("one plan per rank");
  if (!plans[0].stage_bf16) return nccl_sim::run_direct(plans, ranks);
  std::vector<SimRank> staged(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!plans[r].stage_bf16) nccl_sim::fail("ranks disagree on bf16 staging");
    SimRank& s = staged[r];
    s.send_len = plans[r].send_elems;
    s.recv_len = plans[r].recv_elems;
    s.send_at = 0;
    s.recv_at = s.send_len * 4;
    s.mem.assign((s.send_len + s.recv_len) * 4, 0);
    for (int64_t e = 0; e < s.send_len; ++e) {
      bf16 v;
      std::memcpy(&v, ranks[r].mem.data() + ranks[r].send_at + e * 2, 2);
      float f = bf16_to_float(v);
      std::memcpy(s.mem.data() + e * 4, &f, 4);
    }
  }
  nccl_sim::run_direct(plans, staged);
  for (size_t r = 0; r < ranks.size(); ++r)
    for (int64_t e = 0; e < staged[r].recv_len; ++e) {
      float f;
      std::memcpy(&f, staged[r].mem.data() + staged[r].recv_at + e * 4, 4);
      bf16 v = float_to_bf16(f);
      std::memcpy(ranks[r].mem.data() + ranks[r].recv_at + e * 2, &v, 2);
    }
}

}  // namespace moecore::testing
