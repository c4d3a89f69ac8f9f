// The NCCL plans of the Communicator's collectives (ops/desc/nccl_desc.h) run through a
// plain-loop interpreter of NCCL's documented semantics on simulated ranks
// (common/nccl_interpreter.h), against the Communicator's semantics (parallel/communicator.h,
// which the MPI backend implements) written here as plain loops: all-reduce, all-gather and
// reduce-scatter in equal and uneven (v) forms, in place (NCCL's rank-offset convention) and
// not, zero counts, all-to-all-v with uneven and zero splits, broadcast; bf16 reductions in f32
// rounded once. Every byte outside the recv buffer must stay as it was (guards around both).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/nccl_interpreter.h"
#include "core/dtype.h"
#include "ops/desc/nccl_desc.h"

namespace moecore::ops::desc {
namespace {

using moecore::testing::nccl_run;
using moecore::testing::SimRank;

constexpr int64_t kGuard = 3;  // elements before, between and after the buffers

std::vector<int64_t> displs_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> d(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) d[r] = d[r - 1] + counts[r - 1];
  return d;
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// How a rank's recv sits relative to its send.
enum class Place { Apart, RecvInSend, SendInRecv };

// One rank's memory: [guard | send | guard | recv | guard] (Apart), or one buffer holding the
// other at element offset `inner_off`. Every element starts at a sentinel; send gets `data`.
template <typename T>
SimRank make_rank(const std::vector<T>& data, int64_t send_len, int64_t recv_len, Place place,
                  int64_t inner_off, int rank) {
  SimRank m;
  const int64_t es = sizeof(T);
  const int64_t outer = place == Place::Apart ? send_len + kGuard + recv_len
                        : place == Place::RecvInSend ? send_len
                                                     : recv_len;
  const int64_t n = 2 * kGuard + outer;
  std::vector<T> init(n);
  for (int64_t i = 0; i < n; ++i) init[i] = T(-1000 - 10 * rank - i);
  m.mem.resize(n * es);
  std::memcpy(m.mem.data(), init.data(), n * es);
  m.send_len = send_len;
  m.recv_len = recv_len;
  switch (place) {
    case Place::Apart:
      m.send_at = kGuard * es;
      m.recv_at = (2 * kGuard + send_len) * es;
      break;
    case Place::RecvInSend:
      m.send_at = kGuard * es;
      m.recv_at = m.send_at + inner_off * es;
      break;
    case Place::SendInRecv:
      m.recv_at = kGuard * es;
      m.send_at = m.recv_at + inner_off * es;
      break;
  }
  std::memcpy(m.mem.data() + m.send_at, data.data(), data.size() * es);
  return m;
}

template <typename T>
std::vector<T> read(const SimRank& m, int64_t at, int64_t n) {
  std::vector<T> v(n);
  std::memcpy(v.data(), m.mem.data() + at, n * sizeof(T));
  return v;
}

// Checks recv == want and that every other byte is what it was, except (in place) the rest of
// send, which the Communicator leaves undefined for reduce-scatter.
template <typename T>
void expect_result(const SimRank& before, const SimRank& after, const std::vector<T>& want,
                   bool send_undefined) {
  const std::vector<T> got = read<T>(after, after.recv_at, after.recv_len);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      EXPECT_EQ(got[i].bits, want[i].bits) << "recv element " << i;
    else
      EXPECT_EQ(got[i], want[i]) << "recv element " << i;
  }
  const int64_t es = sizeof(T);
  for (int64_t b = 0; b < static_cast<int64_t>(before.mem.size()); ++b) {
    const bool in_recv = b >= after.recv_at && b < after.recv_at + after.recv_len * es;
    const bool in_send = b >= after.send_at && b < after.send_at + after.send_len * es;
    if (in_recv || (send_undefined && in_send)) continue;
    ASSERT_EQ(before.mem[b], after.mem[b]) << "byte " << b << " outside recv changed";
  }
}

template <typename T>
std::vector<T> rank_data(int rank, int64_t n, int salt) {
  std::vector<T> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = T(static_cast<float>((rank + 1) * 16 + ((i * 7 + salt) % 13) - 6));
  return v;
}

template <typename T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, bf16>) return bf16_to_float(x); else return static_cast<double>(x);
}

template <typename T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, bf16>) return float_to_bf16(static_cast<float>(x)); else return static_cast<T>(x);
}

// ---- the Communicator's semantics (communicator.h), plain loops ----

// all_gather(_v): recv = concat over ranks r of send_r (counts[r] each), on every rank.
template <typename T>
void check_all_gather(const std::vector<int64_t>& counts, bool equal, bool in_place, DType dt) {
  SCOPED_TRACE(::testing::Message() << "all_gather R=" << counts.size() << " equal=" << equal
                                    << " in_place=" << in_place);
  const int R = static_cast<int>(counts.size());
  const std::vector<int64_t> displs = displs_of(counts);
  std::vector<T> want;
  std::vector<SimRank> ranks, before;
  std::vector<NcclPlan> plans;
  for (int r = 0; r < R; ++r) {
    auto d = rank_data<T>(r, counts[r], 1);
    want.insert(want.end(), d.begin(), d.end());
    ranks.push_back(make_rank<T>(d, counts[r], sum(counts),
                                 in_place ? Place::SendInRecv : Place::Apart, displs[r], r));
    plans.push_back(nccl_all_gather_v(r, counts, equal, dt));
  }
  before = ranks;
  nccl_run(plans, ranks);
  for (int r = 0; r < R; ++r) expect_result<T>(before[r], ranks[r], want, false);
}

// reduce_scatter(_v): recv_r (counts[r]) = op over ranks q of send_q[displs[r], + counts[r]).
template <typename T>
void check_reduce_scatter(const std::vector<int64_t>& counts, bool equal, bool in_place, DType dt,
                          NcclRedOp op) {
  SCOPED_TRACE(::testing::Message() << "reduce_scatter R=" << counts.size() << " equal=" << equal
                                    << " in_place=" << in_place << " op=" << int(op));
  const int R = static_cast<int>(counts.size());
  const std::vector<int64_t> displs = displs_of(counts);
  const int64_t total = sum(counts);
  std::vector<std::vector<T>> send(R);
  std::vector<SimRank> ranks;
  std::vector<NcclPlan> plans;
  for (int r = 0; r < R; ++r) {
    send[r] = rank_data<T>(r, total, 3);
    ranks.push_back(make_rank<T>(send[r], total, counts[r],
                                 in_place ? Place::RecvInSend : Place::Apart, displs[r], r));
    plans.push_back(nccl_reduce_scatter_v(r, counts, equal, dt, op));
  }
  const std::vector<SimRank> before = ranks;
  nccl_run(plans, ranks);
  for (int r = 0; r < R; ++r) {
    std::vector<T> want(counts[r]);
    for (int64_t e = 0; e < counts[r]; ++e) {
      double v = as_double(send[0][displs[r] + e]);  // reduced in f32 or wider, rounded once
      for (int q = 1; q < R; ++q) {
        double x = as_double(send[q][displs[r] + e]);
        v = op == NcclRedOp::Sum ? v + x : std::max(v, x);
      }
      want[e] = from_double<T>(v);
    }
    expect_result<T>(before[r], ranks[r], want, in_place);
  }
}

TEST(DescNccl, AllGatherEqualAndUneven) {
  for (bool in_place : {false, true}) {
    check_all_gather<float>({4, 4, 4}, true, in_place, DType::F32);
    check_all_gather<float>({3, 0, 2, 1}, false, in_place, DType::F32);
    check_all_gather<int64_t>({0, 5}, false, in_place, DType::I64);
    check_all_gather<bf16>({2, 3, 1}, false, in_place, DType::BF16);
    check_all_gather<float>({1}, true, in_place, DType::F32);
  }
}

TEST(DescNccl, ReduceScatterInPlaceIsNcclsRankOffset) {
  for (bool in_place : {false, true}) {
    check_reduce_scatter<float>({3, 3, 3}, true, in_place, DType::F32, NcclRedOp::Sum);
    check_reduce_scatter<double>({2, 2}, true, in_place, DType::F64, NcclRedOp::Max);
    check_reduce_scatter<float>({2, 0, 3, 1}, false, in_place, DType::F32, NcclRedOp::Sum);
    check_reduce_scatter<int32_t>({0, 4, 1}, false, in_place, DType::I32, NcclRedOp::Max);
    check_reduce_scatter<bf16>({3, 1, 2}, false, in_place, DType::BF16, NcclRedOp::Sum);
    check_reduce_scatter<bf16>({2, 2}, true, in_place, DType::BF16, NcclRedOp::Sum);
  }
  // bf16 reductions run in f32 staging, reduced once (communicator.h).
  EXPECT_TRUE(nccl_reduce_scatter_v(0, std::vector<int64_t>{1, 1}, true, DType::BF16,
                                    NcclRedOp::Sum).stage_bf16);
}

TEST(DescNccl, AllReduceAndBroadcastInPlace) {
  const int R = 3;
  const int64_t n = 5;
  for (NcclRedOp op : {NcclRedOp::Sum, NcclRedOp::Max}) {
    std::vector<SimRank> ranks;
    std::vector<std::vector<float>> data(R);
    std::vector<NcclPlan> plans;
    for (int r = 0; r < R; ++r) {
      data[r] = rank_data<float>(r, n, 5);
      // all_reduce is in place on data, the recv buffer.
      ranks.push_back(make_rank<float>({}, 0, n, Place::Apart, 0, r));
      std::memcpy(ranks[r].mem.data() + ranks[r].recv_at, data[r].data(), n * 4);
      plans.push_back(nccl_all_reduce(n, DType::F32, op));
    }
    const auto before = ranks;
    nccl_run(plans, ranks);
    std::vector<float> want(n);
    for (int64_t e = 0; e < n; ++e) {
      want[e] = data[0][e];
      for (int q = 1; q < R; ++q)
        want[e] = op == NcclRedOp::Sum ? want[e] + data[q][e] : std::max(want[e], data[q][e]);
    }
    for (int r = 0; r < R; ++r) expect_result<float>(before[r], ranks[r], want, false);
  }
  // broadcast from root 2
  std::vector<SimRank> ranks;
  std::vector<NcclPlan> plans;
  for (int r = 0; r < R; ++r) {
    ranks.push_back(make_rank<int32_t>({}, 0, n, Place::Apart, 0, r));
    auto d = rank_data<int32_t>(r, n, 2);
    std::memcpy(ranks[r].mem.data() + ranks[r].recv_at, d.data(), n * 4);
    plans.push_back(nccl_broadcast(n, DType::I32, 2));
  }
  const auto before = ranks;
  nccl_run(plans, ranks);
  for (int r = 0; r < R; ++r) expect_result<int32_t>(before[r], ranks[r], rank_data<int32_t>(2, n, 2), false);
}

// all_to_all_v: rank r sends sc[r][q] elements to q; recv_r = concat over q of q's piece for r.
TEST(DescNccl, AllToAllVUnevenAndZeroSplits) {
  const std::vector<std::vector<std::vector<int64_t>>> cases = {
      {{1, 2, 0}, {0, 3, 1}, {2, 0, 0}},  // zero splits, self sends
      {{0, 0}, {0, 0}},                   // nothing at all
      {{4}},                              // one rank: a self copy
      {{0, 1, 2, 3}, {3, 0, 1, 2}, {2, 3, 0, 1}, {1, 2, 3, 0}}};
  for (const auto& sc : cases) {
    const int R = static_cast<int>(sc.size());
    SCOPED_TRACE(::testing::Message() << "all_to_all_v R=" << R);
    std::vector<SimRank> ranks;
    std::vector<NcclPlan> plans;
    std::vector<std::vector<float>> send(R);
    for (int r = 0; r < R; ++r) {
      std::vector<int64_t> rc(R);
      for (int q = 0; q < R; ++q) rc[q] = sc[q][r];
      send[r] = rank_data<float>(r, sum(sc[r]), 4);
      ranks.push_back(make_rank<float>(send[r], sum(sc[r]), sum(rc), Place::Apart, 0, r));
      plans.push_back(nccl_all_to_all_v(r, sc[r], rc, DType::F32));
    }
    const auto before = ranks;
    nccl_run(plans, ranks);
    for (int r = 0; r < R; ++r) {
      std::vector<float> want;
      for (int q = 0; q < R; ++q) {
        const int64_t off = displs_of(sc[q])[r];
        want.insert(want.end(), send[q].begin() + off, send[q].begin() + off + sc[q][r]);
      }
      expect_result<float>(before[r], ranks[r], want, false);
    }
  }
}

TEST(DescNccl, DataTypes) {
  EXPECT_EQ(static_cast<int>(nccl_data_type(DType::F32)), 7);
  EXPECT_EQ(static_cast<int>(nccl_data_type(DType::F64)), 8);
  EXPECT_EQ(static_cast<int>(nccl_data_type(DType::BF16)), 9);
  EXPECT_EQ(static_cast<int>(nccl_data_type(DType::I32)), 2);
  EXPECT_EQ(static_cast<int>(nccl_data_type(DType::I64)), 4);
}

}  // namespace
}  // namespace moecore::ops::desc
