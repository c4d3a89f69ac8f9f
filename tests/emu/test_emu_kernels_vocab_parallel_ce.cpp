// The vocab-parallel cross entropy's row kernels (src/ops/cuda/vocab_parallel_ce.cu) in the grid
// emulator against their `_ref` oracles: no rows, one row of one column, slices at the start, in
// the middle and at the end of the vocabulary, rows wider than the 256-thread block, more rows
// than the finish's block; targets ignored, on the slice's first and last column, below and above
// the slice. The maxima, the target logits, the finish (lse, loss and the accumulated sum) bitwise
// the reference (exact, or the same formula and the same row-order sum); the exp sums and the
// gradient within the dtype's tolerance; NaN-filled guarded outputs, every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore {
namespace {

using emu_test::append;
using emu_test::expect_bitwise;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

struct Shape {
  int64_t m, v0, Vl, V;
};

// (rows, slice): none; one row of one column (the whole vocabulary); a one-column slice; slices
// at the start, middle and end; rows past the block (256 and 257 columns, 600 columns). More
// rows than the finish's 256 threads: FinishOfManyRows below.
const std::vector<Shape> kShapes = {{0, 0, 1, 1},     {1, 0, 1, 1},       {3, 5, 1, 7},
                                    {7, 37, 37, 111}, {5, 0, 300, 600},   {9, 256, 257, 513},
                                    {4, 0, 256, 256}, {6, 600, 600, 1200}};

template <typename T>
Guarded<T> nan_filled(int64_t n) {
  return Guarded<T>(n, std::numeric_limits<T>::quiet_NaN());
}

// Row i's target: every kind in turn (ignored, the slice's first and last column, below and
// above the slice when there are such columns, anywhere in the vocabulary).
std::vector<int32_t> targets(const Shape& s, uint32_t seed) {
  std::vector<int32_t> tg(size_t(s.m));
  for (int64_t i = 0; i < s.m; ++i) {
    int64_t t = 0;
    switch (i % 6) {
      case 0:
        t = -1;
        break;
      case 1:
        t = s.v0;
        break;
      case 2:
        t = s.v0 + s.Vl - 1;
        break;
      case 3:
        t = s.v0 > 0 ? s.v0 - 1 : s.v0 + s.Vl / 2;
        break;
      case 4:
        t = s.v0 + s.Vl < s.V ? s.v0 + s.Vl : s.v0;
        break;
      default:
        t = int64_t((uint64_t(i) * 2654435761u + seed) % uint64_t(s.V));
        break;
    }
    tg[size_t(i)] = int32_t(t);
  }
  return tg;
}

// Within the tolerance of the kernel's dtype T (the exp sums are f64 sums of T's exps).
template <typename T, typename U>
void expect_near_all(const Guarded<U>& got, const std::vector<U>& want, const char* what) {
  ASSERT_TRUE(got.intact()) << what << " written outside its elements";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(double(got[int64_t(i)]), double(want[i]),
                kAtol<T> + kRtol<T> * std::abs(double(want[i])))
        << what << " element " << i;
  }
}

template <typename T>
void check_rows(const Shape& s, uint32_t seed) {
  SCOPED_TRACE("m=" + std::to_string(s.m) + " columns [" + std::to_string(s.v0) + ", " +
               std::to_string(s.v0 + s.Vl) + ") of V=" + std::to_string(s.V));
  const ops::VocabSlice vs{s.v0, s.Vl, s.V};
  const int64_t m = s.m, n = s.m * s.Vl;
  const std::vector<T> z = random_vec<T>(n, seed, -6.0, 6.0);
  const std::vector<int32_t> tg = targets(s, seed);
  const T dloss = T(0.375);
  const double sum0 = 0.625;  // the finish adds onto the previous chunks' sum

  std::vector<T> mx_ref(static_cast<size_t>(m)), loss_ref(static_cast<size_t>(m)),
      lse_ref(static_cast<size_t>(m)), g_ref = z;
  std::vector<double> sums_ref(static_cast<size_t>(2 * m)), sum_ref{sum0};
  ops::vocab_ce_row_max_ref(mx_ref.data(), z.data(), m, vs);
  ops::vocab_ce_row_sums_ref(sums_ref.data(), z.data(), mx_ref.data(), tg.data(), m, vs);
  ops::vocab_ce_finish_ref(sum_ref.data(), loss_ref.data(), lse_ref.data(), mx_ref.data(),
                           sums_ref.data(), tg.data(), m);
  ops::vocab_ce_grad_ref(g_ref.data(), tg.data(), lse_ref.data(), dloss, m, vs);
  const std::vector<double> exp_sums_ref(sums_ref.begin(), sums_ref.begin() + m),
      logits_ref(sums_ref.begin() + m, sums_ref.end());

  // Each kernel on the reference's inputs, so that each is compared alone.
  Guarded<T> mx(m), loss(m), lse(m), g(n);
  Guarded<double> sums(2 * m), sum(1);
  const std::string diff = order_dependence([&] {
    Guarded<T> mx1 = nan_filled<T>(m), loss1 = nan_filled<T>(m), lse1 = nan_filled<T>(m),
               g1 = emu_test::guarded(z);
    Guarded<double> sums1 = nan_filled<double>(2 * m), sum1(1, sum0);
    ops::cuda::vocab_ce_row_max(nullptr, mx1.data(), z.data(), m, vs);
    ops::cuda::vocab_ce_row_sums(nullptr, sums1.data(), z.data(), mx_ref.data(), tg.data(), m, vs);
    ops::cuda::vocab_ce_finish(nullptr, sum1.data(), loss1.data(), lse1.data(), mx_ref.data(),
                               sums_ref.data(), tg.data(), m);
    ops::cuda::vocab_ce_grad(nullptr, g1.data(), tg.data(), lse_ref.data(), &dloss, m, vs);
    mx = mx1;
    sums = sums1;
    sum = sum1;
    loss = loss1;
    lse = lse1;
    g = g1;
    std::vector<unsigned char> out;
    append(out, mx1);
    append(out, sums1);
    append(out, sum1);
    append(out, loss1);
    append(out, lse1);
    append(out, g1);
    return out;
  });
  EXPECT_EQ(diff, "");
  expect_bitwise(mx, mx_ref, "row max");
  ASSERT_TRUE(sums.intact()) << "sums written outside its elements";
  Guarded<double> exp_sums(m), logits(m);
  for (int64_t i = 0; i < m; ++i) {
    exp_sums[i] = sums[i];
    logits[i] = sums[m + i];
  }
  expect_near_all<T>(exp_sums, exp_sums_ref, "exp sums");
  expect_bitwise(logits, logits_ref, "target logits");
  expect_bitwise(lse, lse_ref, "lse");
  expect_bitwise(loss, loss_ref, "loss");
  expect_bitwise(sum, sum_ref, "loss sum (accumulated)");
  expect_near_all<T>(g, g_ref, "dlogits");
}

TEST(EmuKernelsVocabParallelCe, RowsMatchTheReferenceInEveryOrder) {
  uint32_t seed = 300;
  for (const Shape& s : kShapes) {
    check_rows<float>(s, seed++);
    check_rows<double>(s, seed++);
  }
}

// The finish of more rows than its block has threads (each thread several rows): bitwise the
// reference's lse, loss and row-order sum (in f64: the f64 sum of f32 losses of this size is
// exact in any order).
TEST(EmuKernelsVocabParallelCe, FinishOfManyRows) {
  const int64_t m = 600;
  const std::vector<double> mx = random_vec<double>(m, 9, -3.0, 3.0);
  const std::vector<double> sums = random_vec<double>(2 * m, 10, 1.0, 50.0);
  std::vector<int32_t> tg(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) tg[size_t(i)] = i % 5 == 3 ? -1 : int32_t(i);
  std::vector<double> loss_ref(static_cast<size_t>(m)), lse_ref(static_cast<size_t>(m));
  std::vector<double> sum_ref{-1.5};
  ops::vocab_ce_finish_ref(sum_ref.data(), loss_ref.data(), lse_ref.data(), mx.data(), sums.data(),
                           tg.data(), m);
  const std::string diff = order_dependence([&] {
    Guarded<double> loss = nan_filled<double>(m), lse = nan_filled<double>(m);
    Guarded<double> sum(1, -1.5);
    ops::cuda::vocab_ce_finish(nullptr, sum.data(), loss.data(), lse.data(), mx.data(), sums.data(),
                               tg.data(), m);
    expect_bitwise(lse, lse_ref, "lse");
    expect_bitwise(loss, loss_ref, "loss");
    expect_bitwise(sum, sum_ref, "loss sum (accumulated)");
    std::vector<unsigned char> out;
    append(out, loss);
    append(out, lse);
    append(out, sum);
    return out;
  });
  EXPECT_EQ(diff, "");
}

// The row max is the CPU's with NaNs too: a NaN first element gives NaN, a NaN elsewhere is
// passed over (wherever it lands in the block's tree).
TEST(EmuKernelsVocabParallelCe, RowMaxTreatsNanAsTheCpuDoes) {
  const int64_t Vl = 300, m = 3;
  const ops::VocabSlice vs{0, Vl, Vl};
  std::vector<float> z = random_vec<float>(m * Vl, 7);
  z[0] = NAN;                // row 0: NaN first
  z[Vl + 1] = NAN;           // row 1: NaN in thread 1's elements
  z[2 * Vl + Vl - 1] = NAN;  // row 2: NaN last
  z[2 * Vl + 10] = 5.0f;
  std::vector<float> want(static_cast<size_t>(m));
  ops::vocab_ce_row_max_ref(want.data(), z.data(), m, vs);
  ASSERT_TRUE(std::isnan(want[0]) && !std::isnan(want[1]) && want[2] == 5.0f);
  const std::string diff = order_dependence([&] {
    Guarded<float> mx = nan_filled<float>(m);
    ops::cuda::vocab_ce_row_max(nullptr, mx.data(), z.data(), m, vs);
    expect_bitwise(mx, want, "row max");
    return emu_test::bytes_of(mx.data(), size_t(m));
  });
  EXPECT_EQ(diff, "");
}

// A target >= V (the CPU refuses it; a kernel cannot throw): its target logit is NaN, so its
// loss; the other rows are unaffected.
TEST(EmuKernelsVocabParallelCe, TargetPastTheVocabularyGivesNanLoss) {
  const int64_t m = 2, Vl = 4;
  const ops::VocabSlice vs{4, Vl, 8};
  const std::vector<float> z = random_vec<float>(m * Vl, 8), mx = {1.f, 1.f};
  const std::vector<int32_t> tg = {8, 5};
  Guarded<double> sums = nan_filled<double>(2 * m);
  ops::cuda::vocab_ce_row_sums(nullptr, sums.data(), z.data(), mx.data(), tg.data(), m, vs);
  EXPECT_TRUE(sums.intact());
  EXPECT_TRUE(std::isfinite(sums[0]) && std::isfinite(sums[1]));
  EXPECT_TRUE(std::isnan(sums[m + 0]));
  EXPECT_EQ(sums[m + 1], double(z[size_t(Vl + 1)]));
  Guarded<float> loss = nan_filled<float>(m), lse = nan_filled<float>(m);
  Guarded<double> sum(1, 0.0);
  ops::cuda::vocab_ce_finish(nullptr, sum.data(), loss.data(), lse.data(), mx.data(), sums.data(),
                             tg.data(), m);
  EXPECT_TRUE(std::isnan(loss[0]) && std::isfinite(loss[1]) && std::isnan(sum[0]));
}

// An empty slice (a TP rank whose share of the padded vocabulary is padding only), at the
// vocabulary's end and past it: row maxima -inf and sums 0 (the all-reduces' identities), as the
// reference; the gradient has no element to write; NaN for a target >= V still.
TEST(EmuKernelsVocabParallelCe, EmptySliceGivesTheReductionsIdentities) {
  for (const ops::VocabSlice vs : {ops::VocabSlice{111, 0, 111}, ops::VocabSlice{148, 0, 111}}) {
    SCOPED_TRACE("empty slice at " + std::to_string(vs.v0) + " of V=" + std::to_string(vs.V));
    const int64_t m = 300;  // more rows than a block has threads
    std::vector<int32_t> tg(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) tg[size_t(i)] = i % 4 == 0 ? -1 : int32_t(i % 111);
    const std::vector<float> gmax = random_vec<float>(m, 3, -2.0, 2.0);
    std::vector<float> mx_ref(static_cast<size_t>(m));
    std::vector<double> sums_ref(static_cast<size_t>(2 * m));
    ops::vocab_ce_row_max_ref(mx_ref.data(), static_cast<const float*>(nullptr), m, vs);
    ops::vocab_ce_row_sums_ref(sums_ref.data(), static_cast<const float*>(nullptr), gmax.data(),
                               tg.data(), m, vs);
    for (int64_t i = 0; i < m; ++i) ASSERT_EQ(mx_ref[size_t(i)], -INFINITY);
    const std::string diff = order_dependence([&] {
      Guarded<float> mx = nan_filled<float>(m);
      Guarded<double> sums = nan_filled<double>(2 * m);
      ops::cuda::vocab_ce_row_max<float>(nullptr, mx.data(), nullptr, m, vs);
      ops::cuda::vocab_ce_row_sums<float>(nullptr, sums.data(), nullptr, gmax.data(), tg.data(), m,
                                          vs);
      const float dloss = 1.f;
      ops::cuda::vocab_ce_grad<float>(nullptr, nullptr, tg.data(), gmax.data(), &dloss, m, vs);
      expect_bitwise(mx, mx_ref, "row max");
      expect_bitwise(sums, sums_ref, "sums");
      std::vector<unsigned char> out;
      append(out, mx);
      append(out, sums);
      return out;
    });
    EXPECT_EQ(diff, "");
  }
}

TEST(EmuKernelsVocabParallelCe, BadArgumentsAreErrors) {
  float v = 0;
  double d = 0;
  const int32_t tg = 0;
  // v0 < 0, Vl < 0, columns past V, no vocabulary (Vl = 0 alone is a rank of padding only).
  const ops::VocabSlice bad_slices[] = {{-1, 2, 4}, {0, -1, 4}, {3, 2, 4}, {0, 0, 0}};
  for (const ops::VocabSlice& vs : bad_slices) {
    EXPECT_THROW(ops::cuda::vocab_ce_row_max<float>(nullptr, &v, &v, 1, vs), Error);
    EXPECT_THROW(ops::cuda::vocab_ce_row_sums<float>(nullptr, &d, &v, &v, &tg, 1, vs), Error);
    EXPECT_THROW(ops::cuda::vocab_ce_grad<float>(nullptr, &v, &tg, &v, &v, 1, vs), Error);
  }
  const ops::VocabSlice ok{0, 1, 1};
  EXPECT_THROW(ops::cuda::vocab_ce_row_max<float>(nullptr, &v, &v, -1, ok), Error);
  EXPECT_THROW(ops::cuda::vocab_ce_finish<float>(nullptr, &d, &v, &v, &v, &d, &tg, -1), Error);
}

}  // namespace
}  // namespace moecore
