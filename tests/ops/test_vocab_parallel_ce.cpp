// Vocab-parallel cross entropy rows and the vocab-parallel embedding lookup: the fast paths
// against the plain-loop references on awkward slices (more than one 256-column block, a ragged
// last block, targets on this slice, on others and ignored), the slices of a vocabulary combined
// in process (the TP group's max and sums) against the whole-vocabulary fused head reference,
// an f64 finite-difference check of the gradient rows, and the sharded embedding's slices
// summing to the whole lookup and gradient. A padded vocabulary's slices (the model's columns of
// each share, the last ones partial or empty) the same way: an empty slice gives the reductions'
// identities (max -inf, sums 0) and no gradient element.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/exec.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore::testing {
namespace {

using ops::VocabSlice;

template <typename T>
std::vector<T> randn(int64_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(gen));
  return v;
}

// Targets of m rows in [0, V), every 5th ignored, the first few forced onto each slice's edges.
std::vector<int32_t> targets(int64_t m, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(m);
  for (int64_t i = 0; i < m; ++i) t[i] = i % 5 == 4 ? -1 : int32_t(gen() % uint32_t(V));
  if (m > 2) {
    t[0] = 0;
    t[1] = int32_t(V - 1);
  }
  return t;
}

// The pieces of one slice, fast path vs reference.
template <typename T>
void check_slice_vs_ref(int64_t m, const VocabSlice& vs, double rtol, double atol) {
  const Exec& ex = cpu_exec();
  const std::vector<T> z = randn<T>(m * vs.Vl, 11, 3.0);
  const std::vector<int32_t> tg = targets(m, vs.V, 7);
  std::vector<T> mx(m), mx_ref(m);
  ops::vocab_ce_row_max<T>(ex, mx.data(), z.data(), m, vs);
  ops::vocab_ce_row_max_ref<T>(mx_ref.data(), z.data(), m, vs);
  for (int64_t i = 0; i < m; ++i) ASSERT_EQ(mx[i], mx_ref[i]) << i;  // exact
  std::vector<double> sums(2 * m), sums_ref(2 * m);
  ops::vocab_ce_row_sums<T>(ex, sums.data(), z.data(), mx.data(), tg.data(), m, vs);
  ops::vocab_ce_row_sums_ref<T>(sums_ref.data(), z.data(), mx.data(), tg.data(), m, vs);
  for (int64_t i = 0; i < m; ++i) {
    EXPECT_NEAR(sums[i], sums_ref[i], rtol * sums_ref[i] + atol) << i;
    EXPECT_EQ(sums[m + i], sums_ref[m + i]) << i;  // the target's logit itself, or 0
  }
  std::vector<T> loss(m), lse(m), loss_ref(m), lse_ref(m);
  double sum = 0.5, sum_ref = 0.5;  // accumulated into
  ops::vocab_ce_finish<T>(ex, &sum, loss.data(), lse.data(), mx.data(), sums_ref.data(), tg.data(),
                          m);
  ops::vocab_ce_finish_ref<T>(&sum_ref, loss_ref.data(), lse_ref.data(), mx.data(), sums_ref.data(),
                              tg.data(), m);
  EXPECT_EQ(sum, sum_ref);
  for (int64_t i = 0; i < m; ++i) {
    EXPECT_EQ(loss[i], loss_ref[i]);
    EXPECT_EQ(lse[i], lse_ref[i]);
  }
  std::vector<T> g = z, g_ref = z;
  const T dloss = T(0.25);
  ops::vocab_ce_grad<T>(ex, g.data(), tg.data(), lse.data(), &dloss, m, vs);
  ops::vocab_ce_grad_ref<T>(g_ref.data(), tg.data(), lse.data(), dloss, m, vs);
  for (int64_t i = 0; i < m * vs.Vl; ++i)
    EXPECT_NEAR(g[i], g_ref[i], rtol * std::abs(g_ref[i]) + atol) << i;
}

// The row maximum wherever it sits: each column of a 300-column row (every vector lane, the
// ragged tail) holds the maximum of one row.
TEST(VocabParallelCe, RowMaxFindsTheMaximumInEveryColumn) {
  const Exec& ex = cpu_exec();
  const int64_t Vl = 300, m = Vl;
  std::vector<float> z = randn<float>(m * Vl, 5);
  for (int64_t i = 0; i < m; ++i) z[i * Vl + i] = 100.f + float(i);
  std::vector<float> mx(m);
  ops::vocab_ce_row_max<float>(ex, mx.data(), z.data(), m, VocabSlice{0, Vl, Vl});
  for (int64_t i = 0; i < m; ++i) EXPECT_EQ(mx[i], 100.f + float(i)) << "row " << i;
}

TEST(VocabParallelCe, FastPathMatchesReferenceOnAwkwardSlices) {
  // 300 columns: a full 256 block and a ragged one; 37: one ragged block; the last slice.
  check_slice_vs_ref<float>(9, VocabSlice{300, 300, 900}, kF32Rtol, kF32Atol);
  check_slice_vs_ref<float>(5, VocabSlice{0, 37, 111}, kF32Rtol, kF32Atol);
  check_slice_vs_ref<double>(7, VocabSlice{74, 37, 111}, kF64Rtol, kF64Atol);
  // Empty slices (a TP rank of padding only): at the vocabulary's end and past it.
  check_slice_vs_ref<float>(6, VocabSlice{111, 0, 111}, kF32Rtol, kF32Atol);
  check_slice_vs_ref<double>(6, VocabSlice{148, 0, 111}, kF64Rtol, kF64Atol);
}

TEST(VocabParallelCe, EmptySliceGivesTheReductionsIdentities) {
  const Exec& ex = cpu_exec();
  const int64_t m = 3;
  const VocabSlice empty{300, 0, 250};
  const std::vector<int32_t> tg = {0, -1, 249};
  std::vector<float> mx(m, 1.f), mx_ref(m, 1.f);
  ops::vocab_ce_row_max<float>(ex, mx.data(), nullptr, m, empty);
  ops::vocab_ce_row_max_ref<float>(mx_ref.data(), nullptr, m, empty);
  std::vector<double> sums(2 * m, 1.0), sums_ref(2 * m, 1.0);
  const std::vector<float> gmax = {0.5f, 0.5f, 0.5f};
  ops::vocab_ce_row_sums<float>(ex, sums.data(), nullptr, gmax.data(), tg.data(), m, empty);
  ops::vocab_ce_row_sums_ref<float>(sums_ref.data(), nullptr, gmax.data(), tg.data(), m, empty);
  for (int64_t i = 0; i < m; ++i) {
    EXPECT_EQ(mx[i], -INFINITY) << i;
    EXPECT_EQ(mx_ref[i], -INFINITY) << i;
  }
  for (int64_t i = 0; i < 2 * m; ++i) {
    EXPECT_EQ(sums[i], 0.0) << i;
    EXPECT_EQ(sums_ref[i], 0.0) << i;
  }
  const float one = 1.f;
  const std::vector<float> lse = {1.f, 1.f, 1.f};
  EXPECT_NO_THROW(ops::vocab_ce_grad<float>(ex, nullptr, tg.data(), lse.data(), &one, m, empty));
  // Bad slices: negative, or columns past the vocabulary.
  for (const VocabSlice& bad :
       {VocabSlice{-1, 0, 8}, VocabSlice{0, -1, 8}, VocabSlice{6, 3, 8}, VocabSlice{0, 0, 0}}) {
    EXPECT_THROW(ops::vocab_ce_row_max<float>(ex, mx.data(), nullptr, 0, bad), Error);
    EXPECT_THROW(ops::vocab_ce_row_max_ref<float>(mx.data(), nullptr, 0, bad), Error);
  }
}

// The slices of a vocabulary of V combined as the TP group does (max, then sums over slices)
// give the fused head reference's loss and log-sum-exp, and the gradient rows its dlogits. The
// shares are Vl columns of the padded vocabulary tp * Vl >= V (V = 0: no padding); each slice
// is the model's columns of its share, the last ones partial or empty.
template <typename T>
void check_slices_combine(int tp, int64_t m, int64_t Vl, int64_t H, double rtol, double atol,
                          int64_t V = 0) {
  SCOPED_TRACE(::testing::Message() << "tp " << tp << ", shares of " << Vl << ", V " << V);
  const Exec& ex = cpu_exec();
  if (V == 0) V = Vl * tp;
  // Rank r's slice: the model's columns of its share.
  auto slice = [&](int r) { return VocabSlice{r * Vl, std::clamp<int64_t>(V - r * Vl, 0, Vl), V}; };
  const std::vector<T> h = randn<T>(m * H, 3), w = randn<T>(V * H, 4, 0.5);
  const std::vector<int32_t> tg = targets(m, V, 5);
  // z = h W^T, whole [m, V] (plain loops), and each slice's columns.
  std::vector<T> z(m * V);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += double(h[i * H + k]) * double(w[v * H + k]);
      z[i * V + v] = T(acc);
    }
  auto slice_of = [&](int r) {
    const int64_t n = slice(r).Vl;
    std::vector<T> zs(m * n);
    for (int64_t i = 0; i < m; ++i) std::copy_n(z.begin() + i * V + r * Vl, n, zs.begin() + i * n);
    return zs;
  };
  std::vector<T> mx(m, T(-INFINITY)), part(m);
  for (int r = 0; r < tp; ++r) {
    ops::vocab_ce_row_max<T>(ex, part.data(), slice_of(r).data(), m, slice(r));
    for (int64_t i = 0; i < m; ++i) mx[i] = std::max(mx[i], part[i]);
  }
  std::vector<double> sums(2 * m, 0.0), sp(2 * m);
  for (int r = 0; r < tp; ++r) {
    ops::vocab_ce_row_sums<T>(ex, sp.data(), slice_of(r).data(), mx.data(), tg.data(), m, slice(r));
    for (int64_t i = 0; i < 2 * m; ++i) sums[i] += sp[i];
  }
  std::vector<T> loss(m), lse(m), loss_ref(m), lse_ref(m);
  double sum = 0;
  ops::vocab_ce_finish<T>(ex, &sum, loss.data(), lse.data(), mx.data(), sums.data(), tg.data(), m);
  const ops::HeadLossShape s{m, H, V, 4};
  const double sum_ref = ops::head_loss_forward_ref<T>(loss_ref.data(), lse_ref.data(), h.data(),
                                                       w.data(), tg.data(), s);
  EXPECT_NEAR(sum, sum_ref, rtol * std::abs(sum_ref) + atol);
  for (int64_t i = 0; i < m; ++i) {
    EXPECT_NEAR(loss[i], loss_ref[i], rtol * std::abs(loss_ref[i]) + atol) << i;
    EXPECT_NEAR(lse[i], lse_ref[i], rtol * std::abs(lse_ref[i]) + atol) << i;
  }
  // dh of the reference head vs sum over slices of dz_slice W_slice.
  const T dloss = T(0.5);
  std::vector<T> dh_ref(m * H), dw_ref(V * H, T(0));
  ops::head_loss_backward_ref<T>(dh_ref.data(), dw_ref.data(), h.data(), w.data(), tg.data(),
                                 lse_ref.data(), dloss, s);
  std::vector<double> dh(m * H, 0.0);
  for (int r = 0; r < tp; ++r) {
    std::vector<T> g = slice_of(r);
    const int64_t n = slice(r).Vl;
    ops::vocab_ce_grad<T>(ex, g.data(), tg.data(), lse.data(), &dloss, m, slice(r));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t k = 0; k < H; ++k)
          dh[i * H + k] += double(g[i * n + j]) * double(w[(r * Vl + j) * H + k]);
  }
  for (int64_t i = 0; i < m * H; ++i)
    EXPECT_NEAR(dh[i], dh_ref[i], rtol * std::abs(dh_ref[i]) + atol) << i;
}

TEST(VocabParallelCe, SlicesCombineToTheWholeVocabularyHead) {
  check_slices_combine<double>(3, 7, 37, 5, kF64Rtol, kF64Atol);
  check_slices_combine<double>(4, 6, 300, 3, kF64Rtol, kF64Atol);
  check_slices_combine<float>(2, 9, 300, 4, kF32Rtol, kF32Atol);
  // Padded: 100 tokens in shares of 37 (37, 37, 26, 0 model columns); 650 in shares of 300
  // (300, 300, 50).
  check_slices_combine<double>(4, 6, 37, 5, kF64Rtol, kF64Atol, 100);
  check_slices_combine<float>(3, 5, 300, 4, kF32Rtol, kF32Atol, 650);
}

// f64 finite differences: d(sum of losses)/dz from the gradient rows (dloss = 1), the loss
// through the pieces over 3 slices of 15 columns, and over 4 shares of 5 columns of 12 tokens
// (padded to 20: slices of 5, 5, 2 and 0 model columns).
void check_gradient_rows_fd(int tp, int64_t Vl, int64_t V, std::vector<int32_t> tg) {
  SCOPED_TRACE(::testing::Message() << "tp " << tp << ", shares of " << Vl << ", V " << V);
  const Exec& ex = cpu_exec();
  const int64_t m = static_cast<int64_t>(tg.size());
  std::vector<double> z = randn<double>(m * V, 21, 2.0);
  auto slice = [&](int r) { return VocabSlice{r * Vl, std::clamp<int64_t>(V - r * Vl, 0, Vl), V}; };
  auto slice_of = [&](const std::vector<double>& zz, int r) {
    const int64_t n = slice(r).Vl;
    std::vector<double> zs(m * n);
    for (int64_t i = 0; i < m; ++i) std::copy_n(zz.begin() + i * V + r * Vl, n, zs.begin() + i * n);
    return zs;
  };
  std::vector<double> lse(m);
  auto total = [&](const std::vector<double>& zz) {
    std::vector<double> mx(m, -INFINITY), part(m), sums(2 * m, 0.0), sp(2 * m), loss(m);
    for (int r = 0; r < tp; ++r) {
      ops::vocab_ce_row_max<double>(ex, part.data(), slice_of(zz, r).data(), m, slice(r));
      for (int64_t i = 0; i < m; ++i) mx[i] = std::max(mx[i], part[i]);
    }
    for (int r = 0; r < tp; ++r) {
      ops::vocab_ce_row_sums<double>(ex, sp.data(), slice_of(zz, r).data(), mx.data(), tg.data(), m,
                                     slice(r));
      for (int64_t i = 0; i < 2 * m; ++i) sums[i] += sp[i];
    }
    double s = 0;
    ops::vocab_ce_finish<double>(ex, &s, loss.data(), lse.data(), mx.data(), sums.data(), tg.data(),
                                 m);
    return s;
  };
  total(z);
  const std::vector<double> lse0 = lse;
  const double one = 1.0;
  std::vector<double> grad(m * V);
  for (int r = 0; r < tp; ++r) {
    std::vector<double> g = slice_of(z, r);
    const int64_t n = slice(r).Vl;
    ops::vocab_ce_grad<double>(ex, g.data(), tg.data(), lse0.data(), &one, m, slice(r));
    for (int64_t i = 0; i < m; ++i)
      std::copy_n(g.begin() + i * n, n, grad.begin() + i * V + r * Vl);
  }
  for (int64_t e = 0; e < m * V; ++e) {
    std::vector<double> zp = z, zm = z;
    zp[e] += kFdStep;
    zm[e] -= kFdStep;
    const double fd = (total(zp) - total(zm)) / (2 * kFdStep);
    EXPECT_NEAR(grad[e], fd, kFdRtol * std::abs(fd) + kFdAtol) << e;
  }
}

TEST(VocabParallelCe, GradientRowsMatchFiniteDifferencesF64) {
  check_gradient_rows_fd(3, 5, 15, {3, -1, 14, 7});
  check_gradient_rows_fd(4, 5, 12, {3, -1, 11, 10});
}

TEST(VocabParallelCe, RefusesTargetsBeyondTheVocabulary) {
  const Exec& ex = cpu_exec();
  const std::vector<float> z(4, 0.f), mx(2, 0.f);
  const std::vector<int32_t> tg = {1, 8};
  std::vector<double> sums(4);
  EXPECT_THROW(ops::vocab_ce_row_sums<float>(ex, sums.data(), z.data(), mx.data(), tg.data(), 2,
                                             VocabSlice{0, 2, 8}),
               Error);
}

// Each slice's lookup (zeros for the others' ids) sums to the whole lookup; each slice's
// gradient is its rows of the whole gradient. Fast path and reference bitwise. Also padded: 7
// tokens in shares of 4 rows (slices of 4, 3 and 0 model rows), the padding rows untouched.
TEST(VocabParallelEmbedding, SlicesSumToTheWholeLookupAndGradient) {
  for (const int64_t V : {12, 7}) {
    SCOPED_TRACE(::testing::Message() << "V " << V << " in 12 rows");
    const Exec& ex = cpu_exec();
    const int tp = 3;
    const int64_t n = 11, H = 70, Vl = 4;  // H over one 64-column backward block
    const std::vector<double> w = randn<double>(tp * Vl * H, 1), dy = randn<double>(n * H, 2);
    std::vector<int32_t> ids(n);
    for (int64_t t = 0; t < n; ++t) ids[t] = int32_t((t * 7 + 3) % V);
    std::vector<double> y(n * H), dw(V * H, 0.0);
    ops::embedding_forward_ref<double>(y.data(), ids.data(), w.data(), n, H, V);
    ops::embedding_backward_ref<double>(dw.data(), dy.data(), ids.data(), n, H, V);
    std::vector<double> ysum(n * H, 0.0);
    for (int r = 0; r < tp; ++r) {
      const double* wr = w.data() + r * Vl * H;
      const int64_t rows = std::clamp<int64_t>(V - r * Vl, 0, Vl);  // the slice's model rows
      // Model rows accumulate onto `base`: 1.0 where every id is distinct (V 12), 0 where ids
      // repeat (V 7: their rows add in token order, which from 1.0 would round otherwise than the
      // whole gradient's from 0); padding rows hold 1.0, which must stay.
      const double base = V == 12 ? 1.0 : 0.0;
      std::vector<double> yr(n * H, NAN), yr_ref(n * H, NAN), dwr(Vl * H, 1.0);
      std::fill(dwr.begin(), dwr.begin() + rows * H, base);
      std::vector<double> dwr_ref = dwr;
      ops::embedding_forward_shard<double>(ex, yr.data(), ids.data(), wr, n, H, r * Vl, rows, V);
      ops::embedding_forward_shard_ref<double>(yr_ref.data(), ids.data(), wr, n, H, r * Vl, rows,
                                               V);
      ops::embedding_backward_shard<double>(ex, dwr.data(), dy.data(), ids.data(), n, H, r * Vl,
                                            rows, V);
      ops::embedding_backward_shard_ref<double>(dwr_ref.data(), dy.data(), ids.data(), n, H, r * Vl,
                                                rows, V);
      for (int64_t i = 0; i < n * H; ++i) {
        ASSERT_EQ(yr[i], yr_ref[i]) << i;
        ysum[i] += yr[i];
      }
      for (int64_t i = 0; i < Vl * H; ++i) {
        ASSERT_EQ(dwr[i], dwr_ref[i]) << i;
        // Accumulated onto base; the padding rows untouched.
        EXPECT_EQ(dwr[i], i < rows * H ? base + dw[r * Vl * H + i] : 1.0) << i;
      }
    }
    for (int64_t i = 0; i < n * H; ++i) EXPECT_EQ(ysum[i], y[i]) << i;
    std::vector<int32_t> bad = ids;
    bad[3] = int32_t(V);  // a padding row's id: not a token of the model
    std::vector<double> yr(n * H);
    EXPECT_THROW(
        ops::embedding_forward_shard<double>(ex, yr.data(), bad.data(), w.data(), n, H, 0, Vl, V),
        Error);
  }
}

}  // namespace
}  // namespace moecore::testing
