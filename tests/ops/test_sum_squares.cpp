// Sum of squares: fast vs the long double reference (relative error of f64 summation over n
// terms), bitwise equal at 1, 2 and 3 threads, exact on small integers, n = 0.
#include <omp.h>

#include <cmath>
#include <vector>

#include "common/testing.h"
#include "ops/sum_squares.h"

namespace moecore::ops {
namespace {

using moecore::testing::random_vec;

template <typename T>
void check() {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1} << 14,
                    (int64_t{1} << 20) + 7}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto x = random_vec<T>(n, 9, -3.0, 3.0);
    double ref = -1, by_threads[3];
    sum_squares_ref(&ref, x.data(), n);
    for (int threads = 1; threads <= 3; ++threads) {
      omp_set_num_threads(threads);
      sum_squares<T>(cpu_exec(), &by_threads[threads - 1], x.data(), n);
    }
    omp_set_num_threads(1);
    // f64 summation: at most about log2(n) + 32 rounding steps of 2^-53 relative, all terms >= 0.
    EXPECT_NEAR(by_threads[0], ref, 1e-13 * ref);
    EXPECT_EQ(by_threads[1], by_threads[0]) << "2 threads vs 1";
    EXPECT_EQ(by_threads[2], by_threads[0]) << "3 threads vs 1";
  }
  std::vector<T> small = {1, -2, 3, 4};
  double s = 0;
  sum_squares<T>(cpu_exec(), &s, small.data(), 4);
  EXPECT_EQ(s, 30.0);
}

// Over ranges (the distributed optimizer's owned shards): empty ranges, a range across a block
// boundary; vs the reference, thread-count invariant, and one range == sum_squares bitwise.
template <typename T>
void check_ranges() {
  const int64_t n = (int64_t{1} << 15) + 100;
  auto x = random_vec<T>(n, 11, -2.0, 2.0);
  const std::vector<ElemRange> ranges = {{5, 0}, {7, 31}, {100, (int64_t{1} << 14) + 9},
                                         {(int64_t{1} << 15), 0}, {(int64_t{1} << 15) + 1, 99}};
  double ref = -1, by_threads[3];
  sum_squares_ranges_ref(&ref, x.data(), ranges.data(), static_cast<int64_t>(ranges.size()));
  for (int threads = 1; threads <= 3; ++threads) {
    omp_set_num_threads(threads);
    sum_squares_ranges<T>(cpu_exec(), &by_threads[threads - 1], x.data(), ranges.data(),
                          static_cast<int64_t>(ranges.size()));
  }
  omp_set_num_threads(1);
  EXPECT_NEAR(by_threads[0], ref, 1e-13 * ref);
  EXPECT_EQ(by_threads[1], by_threads[0]) << "2 threads vs 1";
  EXPECT_EQ(by_threads[2], by_threads[0]) << "3 threads vs 1";
  double whole = -1, one = -2;
  const ElemRange all{3, n - 3};
  sum_squares<T>(cpu_exec(), &whole, x.data() + 3, n - 3);
  sum_squares_ranges<T>(cpu_exec(), &one, x.data(), &all, 1);
  EXPECT_EQ(one, whole);
  double none = -1;
  sum_squares_ranges<T>(cpu_exec(), &none, x.data(), nullptr, 0);
  EXPECT_EQ(none, 0.0);
}

TEST(SumSquares, RangesF32) { check_ranges<float>(); }
TEST(SumSquares, RangesF64) { check_ranges<double>(); }

TEST(SumSquares, AccurateAndThreadCountInvariantF32) {
  check<float>();
}
TEST(SumSquares, AccurateAndThreadCountInvariantF64) {
  check<double>();
}

}  // namespace
}  // namespace moecore::ops
