// The sum-of-squares kernels (src/ops/cuda/sum_squares.cu) in the grid emulator against their
// long double references within 1e-13 relative (docs/numerics.md: the sum of squares' own
// tolerance), bitwise the same in every resume order, with the output guarded and NaN-filled (the
// ranges form adds into *out after its first range: the first must write it); one block and the
// two stages (blocks' partials, then one block over them), x at every offset from a 16-byte
// boundary.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/sum_squares.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

constexpr double kRtol = 1e-13;  // tests/ops/test_sum_squares.cpp's

// out of sum_squares (ranges null) or sum_squares_ranges, in every resume order or in the default
// one alone (`orders` false: large sizes).
template <typename T>
double run_kernel(const T* x, int64_t n, const std::vector<ops::ElemRange>* ranges,
                  bool orders = true) {
  const int64_t n_ranges = ranges ? int64_t(ranges->size()) : 0;
  Guarded<double> out(1, NAN);
  const auto run = [&] {
    Guarded<double> out1(1, NAN);
    if (ranges)
      ops::cuda::sum_squares_ranges(nullptr, out1.data(), x, ranges->data(), n_ranges);
    else
      ops::cuda::sum_squares(nullptr, out1.data(), x, n);
    out = out1;
    return bytes_of(out1.data(), 1);
  };
  if (orders)
    EXPECT_EQ(order_dependence(run), "");
  else
    run();
  EXPECT_TRUE(out.intact()) << "written outside *out";
  return out[0];
}

// off = 0: x 16-byte aligned (the vector kernel, tails of every length); 1: one element off.
template <typename T>
void check_sum_squares(int64_t n, int64_t off = 0, bool orders = true) {
  SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(off));
  const std::vector<T> padded = random_vec<T>(n + off, 71, -2.0, 2.0);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(padded.data()) % 16, 0u);
  const std::vector<T> x(padded.begin() + off, padded.end());
  double want = NAN;
  ops::sum_squares_ref(&want, x.data(), n);
  const double got = run_kernel(padded.data() + off, n, nullptr, orders);
  EXPECT_NEAR(got, want, kRtol * want);
  if (n == 0) {
    EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << "an empty sum is +0";
  }
}

// Sizes with every tail length, around the block (1024 threads) and its 16-byte step (4096 f32,
// 2048 f64: threads then take several steps; in one order for the largest), aligned and one
// element off.
TEST(EmuKernelsSumSquares, MatchesTheReferenceInEveryOrder) {
  for (int64_t n : {0, 1, 2, 3, 5, 31, 1023, 1025, 4099, 9000}) {
    for (int64_t off : {0, 1}) {
      check_sum_squares<float>(n, off);
      check_sum_squares<double>(n, off);
    }
  }
  check_sum_squares<float>(4 * 1024 * 37 + 4 * 37 + 3, 0, /*orders=*/false);
  check_sum_squares<float>(1024 * 37 + 37, 1, /*orders=*/false);
}

template <typename T>
void check_ranges() {
  const int64_t n = 3000;
  const std::vector<T> x = random_vec<T>(n, 72, -2.0, 2.0);
  // Empty ranges, one element, a range past a block, out of order, overlapping; begins 16-byte
  // aligned (0, 100, 200, 1500) and not (2999).
  const std::vector<ops::ElemRange> ranges = {{0, 100},  {150, 0},    {2999, 1}, {200, 1000},
                                              {1500, 3}, {100, 1400}, {0, 0}};
  double want = NAN;
  ops::sum_squares_ranges_ref(&want, x.data(), ranges.data(), int64_t(ranges.size()));
  EXPECT_NEAR(run_kernel(x.data(), n, &ranges), want, kRtol * want);

  // One range gives sum_squares' bits; no ranges give +0.
  const std::vector<T> tail(x.begin() + 200, x.begin() + 1200);
  const std::vector<ops::ElemRange> one = {{200, 1000}}, none = {};
  const double by_range = run_kernel(x.data(), n, &one);
  const double whole = run_kernel(tail.data(), int64_t(tail.size()), nullptr);
  EXPECT_EQ(std::memcmp(&by_range, &whole, sizeof(double)), 0) << by_range << " vs " << whole;
  const double zero = run_kernel(x.data(), n, &none), plus_zero = 0.0;
  EXPECT_EQ(std::memcmp(&zero, &plus_zero, sizeof(double)), 0) << zero;
}

// The two stages: several blocks of 256 threads (one per 4096 elements, at most 1056), x 0 to 3
// elements past a 16-byte boundary (the head before the first whole vector), tails of every
// length; and the full grid, whose 1056 partials stage 2's threads take several at a time (in one
// order: 270k threads).
TEST(EmuKernelsSumSquares, MultiBlockMatchesTheReferenceInEveryOrder) {
  for (int64_t n : {4097, 9000, 3 * 4096 + 5, 70001}) {
    for (int64_t off : {0, 1, 2, 3}) {
      check_sum_squares<float>(n, off);
      if (off < 2) check_sum_squares<double>(n, off);
    }
  }
  check_sum_squares<float>(1100 * 4096 + 7, 3, /*orders=*/false);
  check_sum_squares<double>(1060 * 4096 + 1, 1, /*orders=*/false);
}

TEST(EmuKernelsSumSquares, RangesMatchTheReferenceInEveryOrder) {
  check_ranges<float>();
  check_ranges<double>();
}

TEST(EmuKernelsSumSquares, BadArgumentsAreErrors) {
  double out = 0;
  float x = 0;
  EXPECT_THROW(ops::cuda::sum_squares<float>(nullptr, &out, &x, -1), Error);
  const ops::ElemRange bad[] = {{0, 1}, {-1, 2}}, bad_count[] = {{0, -1}};
  EXPECT_THROW(ops::cuda::sum_squares_ranges<float>(nullptr, &out, &x, bad, -1), Error);
  EXPECT_THROW(ops::cuda::sum_squares_ranges<float>(nullptr, &out, &x, bad + 1, 1), Error);
  EXPECT_THROW(ops::cuda::sum_squares_ranges<float>(nullptr, &out, &x, bad_count, 1), Error);
}

}  // namespace
}  // namespace moecore
