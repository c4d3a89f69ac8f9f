// The MPI communicator's ring reductions (the default reduce_scatter / reduce_scatter_v and
// all_reduce of the MPI backend) under mpirun on 1 to 8 ranks, oversubscribed. Each rank's input is a known
// function of (rank, index) with fractions, so that sums round:
// - the result equals the plain sum over ranks (f64 reference, f32 within its rounding), and
//   is bitwise the documented order of the ring: piece c summed as
//   (((x_{c+1} + x_{c+2}) + ...) + x_{c-1}) + x_c, so every run sums every element the same way;
// - uneven counts: zeros, one rank holding every element, everything empty, odd lengths;
// - the all-reduce: every rank the same sums, each element summed as the reduce-scatter of the
//   pieces of ceil(count / g) elements sums it (the distributed optimizer's shards: bitwise);
// - every dtype (bf16 summed in f32 and rounded once), sum and max, in place and out of place;
// - non-blocking: several reduce-scatters in flight at once with an all-reduce, an all-to-all
//   and point-to-point messages, completed in reverse order or by polling, and a rank that waits
//   for something else while its ring is in flight (the others' rings need its steps: the ring
//   must advance inside any wait of the process, as Open MPI's libnbc schedules do).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/mpi_testing.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {
namespace {

Runtime g_rt;
ProcessGroups* g_groups = nullptr;

Communicator& world() {
  return g_groups->world().communicator();
}

// Rank r's element i: a fraction (not exact in binary), different on every rank.
double xval(int r, int64_t i) {
  return static_cast<double>((r * 131 + i * 17) % 97) / 7.0 + r * 0.013;
}

template <typename T>
T cast(double v) {
  if constexpr (std::is_same_v<T, bf16>)
    return float_to_bf16(static_cast<float>(v));
  else if constexpr (std::is_integral_v<T>)
    return static_cast<T>(std::lround(v * 8));
  else
    return static_cast<T>(v);
}
template <typename T>
double num(T v) {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_to_float(v);
  else
    return static_cast<double>(v);
}
// The type the ring reduces in (bf16 in f32).
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, bf16>, float, T>;
template <typename T>
Acc<T> acc(T v) {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_to_float(v);
  else
    return v;
}

// Element j of piece c (global index g) as the ring sums it: starting on rank c+1, each next
// rank adding its own term last.
template <typename T>
T ring_order(int c, int64_t g, int n, ReduceOp op) {
  Acc<T> s = acc(cast<T>(xval((c + 1) % n, g)));
  for (int k = 2; k <= n; ++k) {
    const Acc<T> x = acc(cast<T>(xval((c + k) % n, g)));
    s = op == ReduceOp::Sum ? static_cast<Acc<T>>(s + x) : std::max(s, x);
  }
  if constexpr (std::is_same_v<T, bf16>)
    return float_to_bf16(s);
  else
    return s;
}

// The plain reduction of element g over ranks 0 .. n-1 in f64 (exact for the integer types),
// and how far the ring's result may be from it (its own dtype's rounding).
template <typename T>
double plain_reduce(int64_t g, int n, ReduceOp op) {
  double plain = op == ReduceOp::Sum ? 0.0 : -1e300;
  for (int r = 0; r < n; ++r) {
    const double x = num(cast<T>(xval(r, g)));
    plain = op == ReduceOp::Sum ? plain + x : std::max(plain, x);
  }
  return plain;
}
template <typename T>
double tolerance(double plain) {
  return std::is_same_v<T, bf16>    ? 8e-3 * std::abs(plain)
         : std::is_same_v<T, float> ? 1e-6 * std::abs(plain)
                                    : 1e-13 * std::abs(plain);
}

std::vector<std::vector<int64_t>> count_patterns(int n) {
  std::vector<std::vector<int64_t>> ps;
  ps.push_back(std::vector<int64_t>(n, 5));  // equal
  std::vector<int64_t> uneven(n);
  for (int r = 0; r < n; ++r) uneven[r] = (r * 5 + 3) % 6;  // 3, 2, 1, 0, 5, 4, ...: zeros
  ps.push_back(uneven);
  std::vector<int64_t> one(n, 0);
  one[n / 2] = 1001;  // one rank holds everything
  ps.push_back(one);
  ps.push_back(std::vector<int64_t>(n, 0));  // nothing at all
  std::vector<int64_t> big(n);
  for (int r = 0; r < n; ++r) big[r] = 4093 + 37 * r;  // odd, uneven, larger
  ps.push_back(big);
  return ps;
}

template <typename T>
class RingReductions : public ::testing::Test {};
using DTypes = ::testing::Types<float, double, int32_t, int64_t, bf16>;
TYPED_TEST_SUITE(RingReductions, DTypes);

TYPED_TEST(RingReductions, EqualsThePlainSumInTheRingsOrder) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  EXPECT_EQ(c.reduction_algorithm(), n == 1 ? "local" : "ring");
  for (const std::vector<int64_t>& counts : count_patterns(n)) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "counts[0] " << counts[0] << " of " << n
                     << (op == ReduceOp::Sum ? " sum" : " max") << (in_place ? " in place" : ""));
        const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
        int64_t off = 0;
        for (int r = 0; r < me; ++r) off += counts[r];
        std::vector<T> send(total);
        for (int64_t g = 0; g < total; ++g) send[g] = cast<T>(xval(me, g));
        std::vector<T> out(counts[me]);
        if (in_place) {
          c.reduce_scatter_v_async(send.data(), send.data() + off, counts, DTypeOf<T>::value, op)
              .wait();
          std::copy(send.begin() + off, send.begin() + off + counts[me], out.begin());
        } else {
          c.reduce_scatter_v(send, out, counts, op);
        }
        for (int64_t j = 0; j < counts[me]; ++j) {
          const int64_t g = off + j;
          ASSERT_EQ(num(out[j]), num(ring_order<T>(me, g, n, op))) << "element " << j;
          const double plain = plain_reduce<T>(g, n, op);
          ASSERT_NEAR(num(out[j]), plain, tolerance<T>(plain)) << "element " << j;
        }
      }
    }
  }
  // The equal-count form is the same ring.
  const int64_t k = 7;
  std::vector<T> send(k * n), out(k);
  for (int64_t g = 0; g < k * n; ++g) send[g] = cast<T>(xval(me, g));
  c.reduce_scatter(send, out);
  for (int64_t j = 0; j < k; ++j) {
    ASSERT_EQ(num(out[j]), num(ring_order<T>(me, me * k + j, n, ReduceOp::Sum))) << j;
  }
}

// The all-reduce: the ring's pieces are ceil(count / g) elements (the trailing ones short or
// empty: counts below g included), every rank gets every piece's sum in the ring's order, and
// that is bitwise the reduce-scatter of the same pieces (what the distributed optimizer's
// reduce-scatter of a gradient bucket gives its shard).
TYPED_TEST(RingReductions, AllReduceIsTheReduceScatterOfItsPiecesGathered) {
  using T = TypeParam;
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{n - 1}, int64_t{5}, int64_t{1003},
                        int64_t{4096 * 3 + 1}}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
      SCOPED_TRACE(::testing::Message() << "count " << count << " on " << n
                                        << (op == ReduceOp::Sum ? " sum" : " max"));
      const int64_t piece = (count + n - 1) / n;
      std::vector<int64_t> counts(n);
      for (int q = 0; q < n; ++q) {
        counts[q] = std::clamp<int64_t>(count - q * piece, 0, piece);
      }
      std::vector<T> x(count);
      for (int64_t g = 0; g < count; ++g) x[g] = cast<T>(xval(me, g));
      std::vector<T> rs(counts[me]);
      c.reduce_scatter_v(x, rs, counts, op);
      c.all_reduce(x, op);
      for (int64_t g = 0; g < count; ++g) {
        const int owner = piece > 0 ? static_cast<int>(g / piece) : 0;
        ASSERT_EQ(num(x[g]), num(ring_order<T>(owner, g, n, op))) << "element " << g;
        const double plain = plain_reduce<T>(g, n, op);
        ASSERT_NEAR(num(x[g]), plain, tolerance<T>(plain)) << "element " << g;
      }
      const int64_t off = std::min<int64_t>(me * piece, count);
      for (int64_t j = 0; j < counts[me]; ++j) {
        ASSERT_EQ(num(x[off + j]), num(rs[j])) << "element " << off + j;
      }
    }
  }
}

// Many collectives in flight on one communicator at once: three reduce-scatters of different
// sizes (one in place), an all-reduce, an all-to-all and a ring of sends; completed in reverse
// start order, the last one by polling. Each result is what the blocking call gives.
TEST(RingReductionsNonBlocking, SeveralInFlightWithOtherCalls) {
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  std::vector<int64_t> a(n), b(n), z(n, 0);
  for (int r = 0; r < n; ++r) {
    a[r] = 1000 + 13 * r;
    b[r] = (r * 7 + 1) % 4;
  }
  const int64_t ta = std::accumulate(a.begin(), a.end(), int64_t{0});
  const int64_t tb = std::accumulate(b.begin(), b.end(), int64_t{0});
  int64_t off_a = 0;
  for (int r = 0; r < me; ++r) off_a += a[r];
  std::vector<float> sa(ta), sb(tb), ia(ta), ra(a[me]), rb(b[me]);
  for (int64_t g = 0; g < ta; ++g) sa[g] = ia[g] = static_cast<float>(xval(me, g));
  for (int64_t g = 0; g < tb; ++g) sb[g] = static_cast<float>(xval(me, g + 5));
  std::vector<double> ar(333, me + 0.5);
  std::vector<int64_t> sc(n), rc(n);
  for (int r = 0; r < n; ++r) {
    sc[r] = (me + 2 * r) % 3;
    rc[r] = (r + 2 * me) % 3;
  }
  std::vector<int32_t> a2a_send, a2a_recv(std::accumulate(rc.begin(), rc.end(), int64_t{0}), -1);
  for (int d = 0; d < n; ++d)
    for (int64_t i = 0; i < sc[d]; ++i) a2a_send.push_back(me * 100 + d * 10 + static_cast<int>(i));
  std::vector<int32_t> p2p_out(9, me), p2p_in(9, -1);
  const int next = (me + 1) % n, prev = (me + n - 1) % n;

  std::vector<CommHandle> hs;
  hs.push_back(c.reduce_scatter_v_async(sa, ra, a));
  hs.push_back(c.all_reduce_async(ar));
  hs.push_back(
      c.reduce_scatter_v_async(ia.data(), ia.data() + off_a, a, DType::F32, ReduceOp::Sum));
  hs.push_back(c.all_to_all_v_async(a2a_send, sc, a2a_recv, rc));
  hs.push_back(c.reduce_scatter_v_async(sb, rb, b));
  if (n > 1) {
    hs.push_back(c.recv_async(p2p_in, prev, /*tag=*/3));
    hs.push_back(c.send_async(p2p_out, next, /*tag=*/3));
  }
  std::vector<float> empty;
  hs.push_back(c.reduce_scatter_v_async(empty, empty, z));
  while (!hs.back().test()) {
  }
  for (size_t i = hs.size(); i-- > 0;) hs[i].wait();

  for (int64_t j = 0; j < a[me]; ++j) {
    const float want = ring_order<float>(me, off_a + j, n, ReduceOp::Sum);
    ASSERT_EQ(ra[j], want) << j;
    ASSERT_EQ(ia[off_a + j], want) << "in place " << j;
  }
  int64_t off_b = 0;
  for (int r = 0; r < me; ++r) off_b += b[r];
  for (int64_t j = 0; j < b[me]; ++j) {
    float want = static_cast<float>(xval((me + 1) % n, off_b + j + 5));
    for (int k = 2; k <= n; ++k) want += static_cast<float>(xval((me + k) % n, off_b + j + 5));
    ASSERT_EQ(rb[j], want) << j;
  }
  for (double v : ar) ASSERT_EQ(v, n * (n - 1) / 2.0 + 0.5 * n);
  int64_t at = 0;
  for (int s = 0; s < n; ++s)
    for (int64_t i = 0; i < rc[s]; ++i) ASSERT_EQ(a2a_recv[at++], s * 100 + me * 10 + i);
  if (n > 1) {
    for (int32_t v : p2p_in) ASSERT_EQ(v, prev);
  }
}

// A rank that waits for something else while its ring is in flight must still take its ring's
// steps: the even ranks wait for their reduce-scatter and then send a token to the next rank;
// the odd ranks wait for that token first. Were the odd ranks' rings advanced only by waits on
// their own handles, the even ranks' rings (which need the odd ranks' steps from 3 ranks on)
// would never finish and the token never come: the group's timeout would end the job.
TEST(RingReductionsNonBlocking, AdvancesWhileTheRankWaitsForAnotherCall) {
  Communicator& c = world();
  const int me = c.rank(), n = c.size();
  std::vector<int64_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = 20000 + r;  // steps large enough not to be eager only
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  int64_t off = 0;
  for (int r = 0; r < me; ++r) off += counts[r];
  std::vector<float> send(total), out(counts[me]);
  for (int64_t g = 0; g < total; ++g) send[g] = static_cast<float>(xval(me, g));
  std::vector<int32_t> token(1, me), got(1, -1);
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  CommHandle in = c.recv_async(got, prev, /*tag=*/7);
  CommHandle rs = c.reduce_scatter_v_async(send, out, counts);
  if (me % 2 == 0) {
    rs.wait();
    c.send(token, next, /*tag=*/7);
    in.wait();
  } else {
    in.wait();  // the ring must move meanwhile
    c.send(token, next, /*tag=*/7);
    rs.wait();
  }
  EXPECT_EQ(got[0], prev);
  for (int64_t j = 0; j < counts[me]; ++j) {
    ASSERT_EQ(out[j], ring_order<float>(me, off + j, n, ReduceOp::Sum)) << j;
  }
}

}  // namespace
}  // namespace moecore::parallel

int main(int argc, char** argv) {
  using namespace moecore::parallel;
  return moecore::testing::run_mpi_tests(argc, argv, &g_rt,
                                         [](ProcessGroups* groups) { g_groups = groups; });
}
