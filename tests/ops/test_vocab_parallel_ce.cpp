// Vocab-parallel cross entropy rows and the vocab-parallel embedding lookup: the fast paths
// against the plain-loop references on awkward slices (more than one 256-column block, a ragged
// last block, targets on this slice, on others and ignored), the slices of a vocabulary combined
// in process (the TP group's max and sums) against the whole-vocabulary fused head reference,
// an f64 finite-difference check of the gradient rows, and the sharded embedding's slices
// summing to the whole lookup and gradient.
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
}

// The slices of a vocabulary of V combined as the TP group does (max, then sums over slices)
// give the fused head reference's loss and log-sum-exp, and the gradient rows its dlogits.
template <typename T>
void check_slices_combine(int tp, int64_t m, int64_t Vl, int64_t H, double rtol, double atol) {
  const Exec& ex = cpu_exec();
  const int64_t V = Vl * tp;
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
    std::vector<T> zs(m * Vl);
    for (int64_t i = 0; i < m; ++i)
      std::copy_n(z.begin() + i * V + r * Vl, Vl, zs.begin() + i * Vl);
    return zs;
  };
  std::vector<T> mx(m, T(-INFINITY)), part(m);
  for (int r = 0; r < tp; ++r) {
    ops::vocab_ce_row_max<T>(ex, part.data(), slice_of(r).data(), m, VocabSlice{r * Vl, Vl, V});
    for (int64_t i = 0; i < m; ++i) mx[i] = std::max(mx[i], part[i]);
  }
  std::vector<double> sums(2 * m, 0.0), sp(2 * m);
  for (int r = 0; r < tp; ++r) {
    ops::vocab_ce_row_sums<T>(ex, sp.data(), slice_of(r).data(), mx.data(), tg.data(), m,
                              VocabSlice{r * Vl, Vl, V});
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
    ops::vocab_ce_grad<T>(ex, g.data(), tg.data(), lse.data(), &dloss, m,
                          VocabSlice{r * Vl, Vl, V});
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < Vl; ++j)
        for (int64_t k = 0; k < H; ++k)
          dh[i * H + k] += double(g[i * Vl + j]) * double(w[(r * Vl + j) * H + k]);
  }
  for (int64_t i = 0; i < m * H; ++i)
    EXPECT_NEAR(dh[i], dh_ref[i], rtol * std::abs(dh_ref[i]) + atol) << i;
}

TEST(VocabParallelCe, SlicesCombineToTheWholeVocabularyHead) {
  check_slices_combine<double>(3, 7, 37, 5, kF64Rtol, kF64Atol);
  check_slices_combine<double>(4, 6, 300, 3, kF64Rtol, kF64Atol);
  check_slices_combine<float>(2, 9, 300, 4, kF32Rtol, kF32Atol);
}

// f64 finite differences: d(sum of losses)/dz from the gradient rows (dloss = 1), the loss
// through the pieces over 3 slices.
TEST(VocabParallelCe, GradientRowsMatchFiniteDifferencesF64) {
  const Exec& ex = cpu_exec();
  const int tp = 3;
  const int64_t m = 4, Vl = 5, V = tp * Vl;
  std::vector<double> z = randn<double>(m * V, 21, 2.0);
  const std::vector<int32_t> tg = {3, -1, 14, 7};
  auto slice_of = [&](const std::vector<double>& zz, int r) {
    std::vector<double> zs(m * Vl);
    for (int64_t i = 0; i < m; ++i)
      std::copy_n(zz.begin() + i * V + r * Vl, Vl, zs.begin() + i * Vl);
    return zs;
  };
  std::vector<double> lse(m);
  auto total = [&](const std::vector<double>& zz) {
    std::vector<double> mx(m, -INFINITY), part(m), sums(2 * m, 0.0), sp(2 * m), loss(m);
    for (int r = 0; r < tp; ++r) {
      ops::vocab_ce_row_max<double>(ex, part.data(), slice_of(zz, r).data(), m,
                                    VocabSlice{r * Vl, Vl, V});
      for (int64_t i = 0; i < m; ++i) mx[i] = std::max(mx[i], part[i]);
    }
    for (int r = 0; r < tp; ++r) {
      ops::vocab_ce_row_sums<double>(ex, sp.data(), slice_of(zz, r).data(), mx.data(), tg.data(), m,
                                     VocabSlice{r * Vl, Vl, V});
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
    ops::vocab_ce_grad<double>(ex, g.data(), tg.data(), lse0.data(), &one, m,
                               VocabSlice{r * Vl, Vl, V});
    for (int64_t i = 0; i < m; ++i)
      std::copy_n(g.begin() + i * Vl, Vl, grad.begin() + i * V + r * Vl);
  }
  for (int64_t e = 0; e < m * V; ++e) {
    std::vector<double> zp = z, zm = z;
    zp[e] += kFdStep;
    zm[e] -= kFdStep;
    const double fd = (total(zp) - total(zm)) / (2 * kFdStep);
    EXPECT_NEAR(grad[e], fd, kFdRtol * std::abs(fd) + kFdAtol) << e;
  }
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
// gradient is its rows of the whole gradient. Fast path and reference bitwise.
TEST(VocabParallelEmbedding, SlicesSumToTheWholeLookupAndGradient) {
  const Exec& ex = cpu_exec();
  const int tp = 3;
  const int64_t n = 11, H = 70, Vl = 4, V = tp * Vl;  // H over one 64-column backward block
  const std::vector<double> w = randn<double>(V * H, 1), dy = randn<double>(n * H, 2);
  std::vector<int32_t> ids(n);
  for (int64_t t = 0; t < n; ++t) ids[t] = int32_t((t * 7 + 3) % V);
  std::vector<double> y(n * H), dw(V * H, 0.0);
  ops::embedding_forward_ref<double>(y.data(), ids.data(), w.data(), n, H, V);
  ops::embedding_backward_ref<double>(dw.data(), dy.data(), ids.data(), n, H, V);
  std::vector<double> ysum(n * H, 0.0);
  for (int r = 0; r < tp; ++r) {
    const double* wr = w.data() + r * Vl * H;
    std::vector<double> yr(n * H, NAN), yr_ref(n * H, NAN), dwr(Vl * H, 1.0), dwr_ref(Vl * H, 1.0);
    ops::embedding_forward_shard<double>(ex, yr.data(), ids.data(), wr, n, H, r * Vl, Vl, V);
    ops::embedding_forward_shard_ref<double>(yr_ref.data(), ids.data(), wr, n, H, r * Vl, Vl, V);
    ops::embedding_backward_shard<double>(ex, dwr.data(), dy.data(), ids.data(), n, H, r * Vl, Vl,
                                          V);
    ops::embedding_backward_shard_ref<double>(dwr_ref.data(), dy.data(), ids.data(), n, H, r * Vl,
                                              Vl, V);
    for (int64_t i = 0; i < n * H; ++i) {
      ASSERT_EQ(yr[i], yr_ref[i]) << i;
      ysum[i] += yr[i];
    }
    for (int64_t i = 0; i < Vl * H; ++i) {
      ASSERT_EQ(dwr[i], dwr_ref[i]) << i;
      EXPECT_EQ(dwr[i], 1.0 + dw[r * Vl * H + i]) << i;  // accumulated onto the 1.0s
    }
  }
  for (int64_t i = 0; i < n * H; ++i) EXPECT_EQ(ysum[i], y[i]) << i;
  std::vector<int32_t> bad = ids;
  bad[3] = int32_t(V);
  std::vector<double> yr(n * H);
  EXPECT_THROW(
      ops::embedding_forward_shard<double>(ex, yr.data(), bad.data(), w.data(), n, H, 0, Vl, V),
      Error);
}

}  // namespace
}  // namespace moecore::testing
