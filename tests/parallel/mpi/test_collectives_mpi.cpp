// Every collective under mpirun (4 ranks, oversubscribed) for every dtype, on awkward sizes
// (odd lengths, zero-length pieces in the v-variants and in all-to-all-v). Each rank fills its
// data with values derived from its rank id (and the destination and index), and checks
// exactly what arrived from whom. Then the process groups of several layouts: each group's
// communicator must hold exactly the ranks the layout says, in order.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <numeric>
#include <vector>

#include "common/mpi_testing.h"
#include "core/check.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {
namespace {

Runtime g_rt;                         // set by main
ProcessGroups* g_groups = nullptr;    // world-only layout, set by main

Communicator& world() { return g_groups->world().communicator(); }

// Values are small integers so every dtype (bf16 included: 8 mantissa bits) holds them exactly.
template <typename T>
T val(int v) {
  if constexpr (std::is_same_v<T, bf16>) return float_to_bf16(static_cast<float>(v));
  else return static_cast<T>(v);
}
template <typename T>
double num(T v) {
  if constexpr (std::is_same_v<T, bf16>) return bf16_to_float(v);
  else return static_cast<double>(v);
}
template <typename T>
std::vector<double> nums(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(num(x));
  return out;
}

// Piece sizes with zeros: counts(r) over 4 ranks = 3, 2, 1, 0.
int64_t vcount(int r) { return (r * 5 + 3) % 6; }
// All-to-all-v: rank src sends a2a(src, dst) elements to dst; zero for several pairs.
int64_t a2a(int src, int dst) { return (src + 2 * dst) % 4; }
// The value of element i of the piece from src to dst.
int piece_val(int src, int dst, int64_t i) { return src * 16 + dst * 4 + static_cast<int>(i % 4); }

template <typename T>
class Collectives : public ::testing::Test {};
using DTypes = ::testing::Types<float, double, int32_t, int64_t, bf16>;
TYPED_TEST_SUITE(Collectives, DTypes);

TYPED_TEST(Collectives, AllReduceSumAndMax) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{1003}}) {
    std::vector<T> s(len), m(len);
    for (int64_t i = 0; i < len; ++i) {
      s[i] = val<T>(me + 1 + static_cast<int>(i % 5));
      m[i] = val<T>(static_cast<int>((me * 7 + i) % 11) - 3);
    }
    c.all_reduce(s);
    c.all_reduce(m, ReduceOp::Max);
    for (int64_t i = 0; i < len; ++i) {
      double want_s = 0, want_m = -1e9;
      for (int r = 0; r < n; ++r) {
        want_s += r + 1 + static_cast<int>(i % 5);
        want_m = std::max<double>(want_m, static_cast<int>((r * 7 + i) % 11) - 3);
      }
      ASSERT_EQ(num(s[i]), want_s) << "sum, element " << i << " of " << len;
      ASSERT_EQ(num(m[i]), want_m) << "max, element " << i << " of " << len;
    }
  }
}

TYPED_TEST(Collectives, AllGatherAndAllGatherV) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  const int64_t k = 5;
  std::vector<T> send(k), recv(k * n);
  for (int64_t i = 0; i < k; ++i) send[i] = val<T>(piece_val(me, 0, i));
  c.all_gather(send, recv);
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < k; ++i) ASSERT_EQ(num(recv[r * k + i]), piece_val(r, 0, i));

  std::vector<int64_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = vcount(r);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<T> vs(counts[me]), vr(total, val<T>(-1));
  for (int64_t i = 0; i < counts[me]; ++i) vs[i] = val<T>(piece_val(me, 1, i));
  c.all_gather_v(vs, vr, counts);
  int64_t off = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < counts[r]; ++i, ++off)
      ASSERT_EQ(num(vr[off]), piece_val(r, 1, i)) << "from rank " << r;

  // In place: this rank's slot of recv is the send buffer.
  std::vector<T> inplace(total, val<T>(-1));
  int64_t my_off = 0;
  for (int r = 0; r < me; ++r) my_off += counts[r];
  for (int64_t i = 0; i < counts[me]; ++i) inplace[my_off + i] = val<T>(piece_val(me, 1, i));
  c.all_gather_v_async(inplace.data() + my_off, inplace.data(), counts, DTypeOf<T>::value).wait();
  EXPECT_EQ(nums(inplace), nums(vr));
}

TYPED_TEST(Collectives, ReduceScatterAndReduceScatterV) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  // The algorithm the environment picked (MOECORE_MPI_REDUCTIONS; ctest runs this file with both).
  const char* env = std::getenv("MOECORE_MPI_REDUCTIONS");
  EXPECT_EQ(c.reduction_algorithm(),
            n == 1 ? "local" : env != nullptr && std::string(env) == "libnbc" ? "libnbc" : "ring");
  const int64_t k = 7;
  std::vector<T> send(k * n), recv(k);
  for (int64_t i = 0; i < k * n; ++i) send[i] = val<T>(me + static_cast<int>(i % 9));
  c.reduce_scatter(send, recv);
  for (int64_t j = 0; j < k; ++j) {
    double want = 0;
    for (int r = 0; r < n; ++r) want += r + static_cast<int>((me * k + j) % 9);
    ASSERT_EQ(num(recv[j]), want) << "element " << j;
  }

  std::vector<int64_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = vcount(r);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<T> vs(total), vr(counts[me]);
  for (int64_t i = 0; i < total; ++i) vs[i] = val<T>((me * 3 + static_cast<int>(i)) % 13);
  c.reduce_scatter_v(vs, vr, counts, ReduceOp::Max);
  int64_t my_off = 0;
  for (int r = 0; r < me; ++r) my_off += counts[r];
  for (int64_t j = 0; j < counts[me]; ++j) {
    double want = -1;
    for (int r = 0; r < n; ++r) want = std::max<double>(want, (r * 3 + my_off + j) % 13);
    ASSERT_EQ(num(vr[j]), want);
  }

  // In place (recv = this rank's own slot of send): uneven counts with an empty piece (the
  // last rank's), then the equal form; the slot gets what the out-of-place call received.
  std::vector<T> ip(vs);
  c.reduce_scatter_v_async(ip.data(), ip.data() + my_off, counts, DTypeOf<T>::value, ReduceOp::Max)
      .wait();
  EXPECT_EQ(nums(std::vector<T>(ip.begin() + my_off, ip.begin() + my_off + counts[me])), nums(vr));
  std::vector<T> ips(send);
  c.reduce_scatter_async(ips.data(), ips.data() + me * k, k, DTypeOf<T>::value, ReduceOp::Sum)
      .wait();
  EXPECT_EQ(nums(std::vector<T>(ips.begin() + me * k, ips.begin() + (me + 1) * k)), nums(recv));
  // Counts whose pieces are longer than their offsets (4, 1, 6, 2 elements): the result that
  // MPI leaves at the buffer's start overlaps the slot it moves to.
  std::vector<int64_t> over(n);
  for (int r = 0; r < n; ++r) over[r] = r % 2 == 0 ? 4 + r : 1 + r / 2;
  const int64_t over_total = std::accumulate(over.begin(), over.end(), int64_t{0});
  int64_t over_off = 0;
  for (int r = 0; r < me; ++r) over_off += over[r];
  std::vector<T> os(over_total), orecv(over[me]);
  for (int64_t i = 0; i < over_total; ++i) os[i] = val<T>((me + 2 * static_cast<int>(i)) % 17);
  c.reduce_scatter_v(os, orecv, over);
  c.reduce_scatter_v_async(os.data(), os.data() + over_off, over, DTypeOf<T>::value,
                           ReduceOp::Sum)
      .wait();
  EXPECT_EQ(nums(std::vector<T>(os.begin() + over_off, os.begin() + over_off + over[me])),
            nums(orecv));
}

TYPED_TEST(Collectives, AllToAllVWithEmptyPieces) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  std::vector<int64_t> sc(n), rc(n);
  for (int r = 0; r < n; ++r) {
    sc[r] = a2a(me, r);
    rc[r] = a2a(r, me);
  }
  std::vector<T> send, recv(std::accumulate(rc.begin(), rc.end(), int64_t{0}), val<T>(-1));
  for (int d = 0; d < n; ++d)
    for (int64_t i = 0; i < sc[d]; ++i) send.push_back(val<T>(piece_val(me, d, i)));
  c.all_to_all_v(send, sc, recv, rc);
  int64_t off = 0;
  for (int s = 0; s < n; ++s)
    for (int64_t i = 0; i < rc[s]; ++i, ++off)
      ASSERT_EQ(num(recv[off]), piece_val(s, me, i)) << "from rank " << s << " element " << i;
  // This rank receives nothing at all when every peer sends it zero: still completes.
  std::vector<int64_t> zeros(n, 0);
  std::vector<T> none;
  c.all_to_all_v(none, zeros, none, zeros);
}

TYPED_TEST(Collectives, BroadcastSendRecvBarrier) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  const int root = n - 2 >= 0 ? n - 2 : 0;
  std::vector<T> b(13, val<T>(-1));
  if (me == root)
    for (int64_t i = 0; i < 13; ++i) b[i] = val<T>(piece_val(root, 0, i));
  c.broadcast(b, root);
  for (int64_t i = 0; i < 13; ++i) ASSERT_EQ(num(b[i]), piece_val(root, 0, i));

  // Ring: rank r sends 2r elements (rank 0 sends none) to r+1.
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<T> out(2 * me), in(2 * prev, val<T>(-1));
  for (int64_t i = 0; i < 2 * me; ++i) out[i] = val<T>(piece_val(me, next, i));
  CommHandle r = c.recv_async(in, prev, /*tag=*/5);
  CommHandle s = c.send_async(out, next, /*tag=*/5);
  s.wait();
  r.wait();
  for (int64_t i = 0; i < 2 * prev; ++i) ASSERT_EQ(num(in[i]), piece_val(prev, me, i));
  c.barrier();
}

TYPED_TEST(Collectives, NonBlockingOverlap) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  std::vector<T> a(257, val<T>(me));
  std::vector<int64_t> sc(n), rc(n);
  for (int r = 0; r < n; ++r) {
    sc[r] = a2a(me, r);
    rc[r] = a2a(r, me);
  }
  std::vector<T> send, recv(std::accumulate(rc.begin(), rc.end(), int64_t{0}));
  for (int d = 0; d < n; ++d)
    for (int64_t i = 0; i < sc[d]; ++i) send.push_back(val<T>(piece_val(me, d, i)));
  std::vector<T> gs(3, val<T>(me)), gr(3 * n);
  // Three operations in flight at once, completed in reverse order, one by polling.
  CommHandle h1 = c.all_reduce_async(a);
  CommHandle h2 = c.all_to_all_v_async(send, sc, recv, rc);
  CommHandle h3 = c.all_gather_async(gs, gr);
  while (!h3.test()) {
  }
  EXPECT_TRUE(h3.done());
  h2.wait();
  h1.wait();
  const double sum = n * (n - 1) / 2.0;
  for (const T& x : a) ASSERT_EQ(num(x), sum);
  int64_t off = 0;
  for (int s = 0; s < n; ++s)
    for (int64_t i = 0; i < rc[s]; ++i, ++off) ASSERT_EQ(num(recv[off]), piece_val(s, me, i));
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 3; ++i) ASSERT_EQ(num(gr[r * 3 + i]), r);
  // A handle dropped while pending is waited for by its destructor.
  std::vector<T> d(9, val<T>(1));
  { CommHandle dropped = c.all_reduce_async(d); }
  for (const T& x : d) ASSERT_EQ(num(x), n);
}

// bf16 sums accumulate in f32 and round once: 256 + 1 + 1 + 1 = 259 -> bf16 260. Accumulating
// in bf16 would give 256 or 258 (256 + 1 rounds back to 256).
TEST(CollectivesBf16, SumsInF32) {
  Communicator& c = world();
  if (c.size() != 4) GTEST_SKIP() << "needs 4 ranks";
  std::vector<bf16> x(5, float_to_bf16(c.rank() == 0 ? 256.f : 1.f));
  c.all_reduce(x);
  for (bf16 v : x) EXPECT_EQ(bf16_to_float(v), 260.f);
  std::vector<bf16> send(8, float_to_bf16(c.rank() == 0 ? 256.f : 1.f)), recv(2);
  c.reduce_scatter(send, recv);
  for (bf16 v : recv) EXPECT_EQ(bf16_to_float(v), 260.f);
}

TEST(CollectivesErrors, RecvSizeMismatchIsReported) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP();
  std::vector<int32_t> three(3, 7), five(5);
  if (c.rank() == 0) c.send(three, 1, 9);
  if (c.rank() == 1) {
    try {
      c.recv(five, 0, 9);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expected 5 elements from rank 0 (tag 9), got 3"),
                std::string::npos)
          << e.what();
    }
  }
  c.barrier();
}

// ---- the process groups of several layouts, connected for real ----

void check_layout(const ParallelConfig& cfg) {
  ProcessGroups groups(make_layout(cfg, g_rt.world_size), g_rt.rank);
  connect_communicators(groups);
  for (GroupKind k : kAllGroupKinds) {
    ProcessGroup& g = groups.group(k);
    Communicator& c = g.communicator();
    ASSERT_EQ(c.size(), g.size()) << g.name;
    ASSERT_EQ(c.rank(), g.rank) << g.name;
    ASSERT_EQ(c.global_ranks(), g.ranks) << g.name;
    // Gathering the world ranks over the group returns the layout's list, in order.
    std::vector<int32_t> mine = {g_rt.rank}, all(g.size());
    c.all_gather(mine, all);
    ASSERT_EQ(all, g.ranks) << g.name;
    std::vector<int64_t> sum = {g_rt.rank};
    c.all_reduce(sum);
    ASSERT_EQ(sum[0], std::accumulate(g.ranks.begin(), g.ranks.end(), int64_t{0})) << g.name;
  }
}

TEST(ProcessGroupsMpi, CommunicatorsMatchLayouts) {
  if (g_rt.world_size != 4) GTEST_SKIP() << "needs 4 ranks";
  ParallelConfig a;  // TP=2 with EP=2 folded over the data-parallel ranks
  a.tp = 2;
  a.ep = 2;
  a.etp = 1;
  a.sequence_parallel = true;
  check_layout(a);
  ParallelConfig b;  // TP=2, PP=2, expert TP 1 x EP 2 within each stage
  b.tp = 2;
  b.pp = 2;
  b.ep = 2;
  b.etp = 1;
  check_layout(b);
  b.use_tp_pp_dp_mapping = true;
  check_layout(b);
  ParallelConfig c;  // CP=2 with EP=4 folded over CP x DP
  c.cp = 2;
  c.ep = 4;
  check_layout(c);
}

}  // namespace
}  // namespace moecore::parallel

int main(int argc, char** argv) {
  using namespace moecore::parallel;
  return moecore::testing::run_mpi_tests(argc, argv, &g_rt,
                                         [](ProcessGroups* groups) { g_groups = groups; });
}
