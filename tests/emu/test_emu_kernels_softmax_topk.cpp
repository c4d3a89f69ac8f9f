// The router's softmax and top-k kernels (src/ops/cuda/softmax_topk.cu) in the grid emulator:
// softmax forward / backward against their `_ref` within the dtype's tolerance (docs/numerics.md),
// top-k bitwise the reference's indices and values, as the CPU fast path's are (ties to the lower
// index, -inf never preferred), with NaN-poisoned guarded outputs, and bitwise the same in every
// resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/softmax_topk.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

struct TE {
  int64_t T, E;
};
// One token, one expert; rows shorter than a warp; E not a multiple of 32; E over the block (more
// than one element per thread); many rows.
const TE kShapes[] = {{1, 1}, {3, 2}, {13, 7}, {3, 33}, {2, 257}, {20, 5}};

template <typename T>
void check_softmax(int64_t n_tok, int64_t E, bool in_place) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " E=" + std::to_string(E) +
               " in_place=" + std::to_string(in_place));
  std::vector<T> x = random_vec<T>(n_tok * E, 51, -20.0, 20.0);
  if (n_tok > 1) {
    for (int64_t e = 0; e < E; ++e) x[size_t(E + e)] = T(-INFINITY);  // a row of -inf: NaN
  }
  const std::vector<T> dy = random_vec<T>(n_tok * E, 52);
  std::vector<T> y_ref(size_t(n_tok * E)), dx_ref(size_t(n_tok * E));
  ops::softmax_forward_ref(y_ref.data(), x.data(), n_tok, E);
  if (n_tok > 1) {  // the backward on a finite y
    for (int64_t e = 0; e < E; ++e) y_ref[size_t(E + e)] = T(1) / T(E);
  }
  ops::softmax_backward_ref(dx_ref.data(), dy.data(), y_ref.data(), n_tok, E);
  Guarded<T> y(n_tok * E), dx(n_tok * E);
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n_tok * E, T(NAN)), dx1(n_tok * E, T(NAN));
    if (in_place) {
      for (int64_t i = 0; i < n_tok * E; ++i) y1[i] = x[size_t(i)];
      for (int64_t i = 0; i < n_tok * E; ++i) dx1[i] = dy[size_t(i)];
      ops::cuda::softmax_forward<T>(nullptr, y1.data(), y1.data(), n_tok, E);
      ops::cuda::softmax_backward<T>(nullptr, dx1.data(), dx1.data(), y_ref.data(), n_tok, E);
    } else {
      ops::cuda::softmax_forward<T>(nullptr, y1.data(), x.data(), n_tok, E);
      ops::cuda::softmax_backward<T>(nullptr, dx1.data(), dy.data(), y_ref.data(), n_tok, E);
    }
    y = y1;
    dx = dx1;
    std::vector<unsigned char> out = bytes_of(y1.data(), size_t(n_tok * E));
    const std::vector<unsigned char> d = bytes_of(dx1.data(), size_t(n_tok * E));
    out.insert(out.end(), d.begin(), d.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact()) << "y written outside its elements";
  EXPECT_TRUE(dx.intact()) << "dx written outside its elements";
  for (int64_t i = 0; i < n_tok * E; ++i) {
    const T want = y_ref[size_t(i)];
    if (n_tok > 1 && i / E == 1) {
      ASSERT_TRUE(std::isnan(y[i])) << "y element " << i << " of a row of -inf";
      continue;
    }
    ASSERT_NEAR(y[i], want, kAtol<T> + kRtol<T> * std::abs(want)) << "y element " << i;
  }
  for (int64_t i = 0; i < n_tok * E; ++i) {
    const T want = dx_ref[size_t(i)];
    ASSERT_NEAR(dx[i], want, kAtol<T> + kRtol<T> * std::abs(want)) << "dx element " << i;
  }
}

TEST(EmuKernelsSoftmaxTopk, SoftmaxMatchesTheReferenceInEveryOrder) {
  for (auto [T, E] : kShapes) {
    check_softmax<float>(T, E, false);
    check_softmax<double>(T, E, false);
    check_softmax<double>(T, E, true);
  }
}

template <typename T>
void check_topk(int64_t n_tok, int64_t E, int64_t K) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " E=" + std::to_string(E) +
               " K=" + std::to_string(K));
  std::vector<T> x = random_vec<T>(n_tok * E, 61, -3.0, 3.0);
  // Ties: every other value rounded to an integer; -inf entries (masked experts).
  for (int64_t i = 0; i < n_tok * E; i += 2) x[size_t(i)] = std::round(x[size_t(i)]);
  for (int64_t i = 5; i < n_tok * E; i += 7) x[size_t(i)] = T(-INFINITY);
  if (n_tok > 2) {
    for (int64_t e = 0; e < E; ++e) x[size_t(2 * E + e)] = T(1);  // a row of ties
  }
  std::vector<int32_t> idx_ref(size_t(n_tok * K));
  std::vector<T> val_ref(size_t(n_tok * K));
  ops::topk_ref(idx_ref.data(), val_ref.data(), x.data(), n_tok, E, K);
  Guarded<int32_t> idx(n_tok * K);
  Guarded<T> val(n_tok * K);
  const std::string diff = order_dependence([&] {
    Guarded<int32_t> idx1(n_tok * K, -7);
    Guarded<T> val1(n_tok * K, T(NAN));
    ops::cuda::topk<T>(nullptr, idx1.data(), val1.data(), x.data(), n_tok, E, K);
    idx = idx1;
    val = val1;
    std::vector<unsigned char> out = bytes_of(idx1.data(), size_t(n_tok * K));
    const std::vector<unsigned char> v = bytes_of(val1.data(), size_t(n_tok * K));
    out.insert(out.end(), v.begin(), v.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(idx.intact()) << "idx written outside its elements";
  EXPECT_TRUE(val.intact()) << "val written outside its elements";
  const size_t n = size_t(n_tok * K);
  EXPECT_EQ(idx.vec(), idx_ref) << "indices differ from the reference's";
  EXPECT_EQ(bytes_of(val.data(), n), bytes_of(val_ref.data(), n)) << "values differ";
}

// K = 1 and K = E, a row of ties, -inf entries; more rows than a block (the warp-per-row grid's
// partial last block); E over a warp and not a multiple of it (lanes with one entry more).
TEST(EmuKernelsSoftmaxTopk, TopkIsTheReferenceBitwiseInEveryOrder) {
  struct Case {
    int64_t T, E, K;
  };
  for (auto c : {Case{1, 1, 1}, Case{3, 4, 4}, Case{13, 7, 1}, Case{13, 7, 3}, Case{5, 64, 8},
                 Case{300, 9, 2}, Case{4, 257, 6}, Case{9, 256, 8}, Case{6, 33, 33}}) {
    check_topk<float>(c.T, c.E, c.K);
    check_topk<double>(c.T, c.E, c.K);
  }
}

// Ties of +0 and -0 (equal: index order; the bits of the chosen entry), and rows with a NaN, whose
// insertion order is no sort order: bitwise the CPU fast path's row body, in every resume order.
template <typename T>
void check_topk_signed_zeros_and_nan() {
  const int64_t n_tok = 5, E = 40, K = 5;
  std::vector<T> x = random_vec<T>(n_tok * E, 62, -3.0, 3.0);
  for (int64_t e = 0; e < E; ++e) x[size_t(e)] = e % 2 ? T(-0.0) : T(0.0);  // row 0
  x[size_t(E + 3)] = T(NAN);                                                // row 1
  x[size_t(2 * E + 0)] = T(NAN);                                            // row 2: first
  x[size_t(3 * E + E - 1)] = T(NAN);                                        // row 3: last
  std::vector<int32_t> idx_cpu(size_t(n_tok * K));
  std::vector<T> val_cpu(size_t(n_tok * K));
  for (int64_t t = 0; t < n_tok; ++t)
    ops::topk_row(idx_cpu.data() + t * K, val_cpu.data() + t * K, x.data() + t * E, E, K);
  Guarded<int32_t> idx(n_tok * K);
  Guarded<T> val(n_tok * K);
  EXPECT_EQ(order_dependence([&] {
              idx = Guarded<int32_t>(n_tok * K, -7);
              val = Guarded<T>(n_tok * K, T(7));
              ops::cuda::topk<T>(nullptr, idx.data(), val.data(), x.data(), n_tok, E, K);
              std::vector<unsigned char> out = bytes_of(idx.data(), size_t(n_tok * K));
              const std::vector<unsigned char> v = bytes_of(val.data(), size_t(n_tok * K));
              out.insert(out.end(), v.begin(), v.end());
              return out;
            }),
            "");
  const size_t n = size_t(n_tok * K);
  EXPECT_EQ(idx.vec(), idx_cpu) << "indices differ from the CPU fast path's";
  EXPECT_EQ(bytes_of(val.data(), n), bytes_of(val_cpu.data(), n)) << "values differ";
}

TEST(EmuKernelsSoftmaxTopk, TopkSignedZerosAndNanRowsAreTheCpuPathBitwise) {
  check_topk_signed_zeros_and_nan<float>();
  check_topk_signed_zeros_and_nan<double>();
}

TEST(EmuKernelsSoftmaxTopk, NoTokensLaunchNothing) {
  ops::cuda::softmax_forward<double>(nullptr, nullptr, nullptr, 0, 8);
  ops::cuda::softmax_backward<double>(nullptr, nullptr, nullptr, nullptr, 0, 8);
  ops::cuda::topk<double>(nullptr, nullptr, nullptr, nullptr, 0, 8, 2);
}

TEST(EmuKernelsSoftmaxTopk, BadArgumentsAreErrors) {
  double v = 0;
  int32_t i = 0;
  EXPECT_THROW(ops::cuda::softmax_forward<double>(nullptr, &v, &v, 1, 0), Error);
  EXPECT_THROW(ops::cuda::softmax_backward<double>(nullptr, &v, &v, &v, -1, 4), Error);
  EXPECT_THROW(ops::cuda::topk<double>(nullptr, &i, &v, &v, 1, 4, 5), Error);
  EXPECT_THROW(ops::cuda::topk<double>(nullptr, &i, &v, &v, 1, 4, 0), Error);
}

}  // namespace
}  // namespace moecore
