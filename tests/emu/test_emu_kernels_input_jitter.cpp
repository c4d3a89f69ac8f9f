// The input jitter kernels (src/ops/cuda/input_jitter.cu) in the grid emulator against their
// `_ref` oracles, bitwise (core/rng.h's rng_uniform is shared with the CPU and the factor and the
// backward's product are rounded one operation at a time, as on the CPU): the step counter read
// from memory, a base past 2^32, lengths below, at and above a block, NaN-poisoned guarded
// outputs, dx accumulated onto nonzero values, in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/input_jitter.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

const std::vector<int64_t> kLengths = {0, 1, 31, 33, 255, 257, 1000, 3001};

template <typename T>
bool same_bits(const T* a, const T* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, sizeof(T) * size_t(n)) == 0;
}

template <typename T>
void check_forward(int64_t n) {
  SCOPED_TRACE("n=" + std::to_string(n));
  const double eps = 0.01;
  const uint64_t key = 0xfeedfacecafebeefull;
  const int64_t step = 5, stride = int64_t(1) << 30;  // base = 5 * 2^30: past 2^32
  const uint32_t lane = 3;
  const std::vector<T> x = random_vec<T>(n, 71);
  std::vector<T> want_j(static_cast<size_t>(n)), want_y(static_cast<size_t>(n));
  ops::input_jitter_forward_ref(want_j.data(), want_y.data(), x.data(), eps, key,
                                uint64_t(step) * uint64_t(stride), lane, n);
  Guarded<T> j(n, T(NAN)), y(n, T(NAN));
  const std::string diff = order_dependence([&] {
    Guarded<T> j1(n, T(NAN)), y1(n, T(NAN));
    ops::cuda::input_jitter_forward(nullptr, j1.data(), y1.data(), x.data(), eps, key, &step,
                                    stride, lane, n);
    j = j1;
    y = y1;
    std::vector<unsigned char> out = bytes_of(j1.data(), size_t(n));
    const std::vector<unsigned char> b = bytes_of(y1.data(), size_t(n));
    out.insert(out.end(), b.begin(), b.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(j.intact() && y.intact()) << "written outside the elements";
  EXPECT_TRUE(same_bits(j.data(), want_j.data(), n)) << "jitter differs from the reference";
  EXPECT_TRUE(same_bits(y.data(), want_y.data(), n)) << "y differs from the reference";
}

template <typename T>
void check_backward(int64_t n) {
  SCOPED_TRACE("n=" + std::to_string(n));
  const std::vector<T> dy = random_vec<T>(n, 72);
  const std::vector<T> jitter = random_vec<T>(n, 73, 0.99, 1.01);
  const std::vector<T> dx0 = random_vec<T>(n, 74);  // dx accumulates onto these
  std::vector<T> want = dx0;
  ops::input_jitter_backward_ref(want.data(), dy.data(), jitter.data(), n);
  Guarded<T> dx(n);
  const std::string diff = order_dependence([&] {
    Guarded<T> dx1(n);
    for (int64_t i = 0; i < n; ++i) dx1[i] = dx0[size_t(i)];
    ops::cuda::input_jitter_backward(nullptr, dx1.data(), dy.data(), jitter.data(), n);
    dx = dx1;
    return bytes_of(dx1.data(), size_t(n));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(dx.intact()) << "dx written outside its elements";
  EXPECT_TRUE(same_bits(dx.data(), want.data(), n)) << "dx differs from the reference";
}

TEST(EmuKernelsInputJitter, ForwardMatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n : kLengths) {
    check_forward<float>(n);
    check_forward<double>(n);
  }
}

TEST(EmuKernelsInputJitter, BackwardMatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n : kLengths) {
    check_backward<float>(n);
    check_backward<double>(n);
  }
}

TEST(EmuKernelsInputJitter, AdvanceIncrementsTheStepCounter) {
  Guarded<int64_t> step(1, 41);
  ops::cuda::input_jitter_advance(nullptr, step.data());
  EXPECT_TRUE(step.intact());
  EXPECT_EQ(step[0], 42);
}

TEST(EmuKernelsInputJitter, BadArgumentsAreErrors) {
  float v = 0;
  const int64_t step = 0;
  EXPECT_THROW(ops::cuda::input_jitter_forward<float>(nullptr, &v, &v, &v, 0.1, 1, &step, 1, 0, -1),
               Error);
  EXPECT_THROW(
      ops::cuda::input_jitter_forward<float>(nullptr, &v, &v, &v, 0.1, 1, nullptr, 1, 0, 1), Error);
  EXPECT_THROW(ops::cuda::input_jitter_backward<float>(nullptr, &v, &v, &v, -1), Error);
  EXPECT_THROW(ops::cuda::input_jitter_advance(nullptr, nullptr), Error);
}

}  // namespace
}  // namespace moecore
