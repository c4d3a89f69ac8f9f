// Load balancing ops: token counts (dropped slots skipped, per sequence, empty experts) fast ==
// reference; the running mean and accumulators exact; the quantile estimate against a full sort
// and its defining property; the expert-bias and quantile-beta updates bitwise against the
// reference, with guard bytes.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/router_balance.h"

namespace moecore::testing {
namespace {

TEST(RouterBalance, CountsMatchRef) {
  struct Case {
    int64_t T, K, E, B;
  };
  std::mt19937 gen(1);
  for (auto c : {Case{1, 1, 1, 1}, Case{12, 2, 8, 3}, Case{9, 7, 7, 1}, Case{40, 1, 13, 4},
                 Case{0, 2, 4, 1}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " K=" << c.K << " E=" << c.E);
    std::vector<int32_t> idx(c.T * c.K);
    std::uniform_int_distribution<int> d(-1, static_cast<int>(c.E / 2));  // drops, empty experts
    for (auto& e : idx) e = d(gen);
    Guarded<int64_t> n(c.E), n_r(c.E), s(c.B * c.E), s_r(c.B * c.E), n2(c.E);
    ops::count_tokens_per_expert(cpu_exec(), n.data(), s.data(), idx.data(), c.T, c.K, c.E, c.B);
    ops::count_tokens_per_expert_ref(n_r.data(), s_r.data(), idx.data(), c.T, c.K, c.E, c.B);
    ops::count_tokens_per_expert(cpu_exec(), n2.data(), nullptr, idx.data(), c.T, c.K, c.E, 1);
    EXPECT_EQ(n.vec(), n_r.vec());
    EXPECT_EQ(s.vec(), s_r.vec());
    EXPECT_EQ(n2.vec(), n.vec());
    for (auto* g : {&n, &n_r, &s, &s_r, &n2}) EXPECT_TRUE(g->intact());
    const int64_t kept = std::count_if(idx.begin(), idx.end(), [](int32_t e) { return e >= 0; });
    const std::vector<int64_t> counts = n.vec();
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t(0)), kept);
  }
}

TEST(RouterBalance, AccumulatorsAndRunningMean) {
  const std::vector<int64_t> c = {3, 0, 7, 1, 5};
  Guarded<double> sum(5), sum_r(5), m(5), m_r(5);
  for (int64_t e = 0; e < 5; ++e) sum[e] = sum_r[e] = 2.0 * e;
  ops::running_mean_counts(cpu_exec(), m.data(), sum.data(), c.data(), 3.0, 5);
  ops::running_mean_counts_ref(m_r.data(), sum.data(), c.data(), 3.0, 5);
  EXPECT_EQ(m.vec(), m_r.vec());
  EXPECT_EQ(m[2], (4.0 + 7.0) / 3.0);
  ops::accumulate_counts(cpu_exec(), sum.data(), c.data(), 5);
  ops::accumulate_counts_ref(sum_r.data(), c.data(), 5);
  EXPECT_EQ(sum.vec(), sum_r.vec());
  EXPECT_EQ(sum[2], 11.0);
  // With the counts already in the sum (recomputation): the same mean.
  Guarded<double> m2(5), m2_r(5);
  ops::running_mean_counts(cpu_exec(), m2.data(), sum.data(), nullptr, 3.0, 5);
  ops::running_mean_counts_ref(m2_r.data(), sum.data(), nullptr, 3.0, 5);
  EXPECT_EQ(m2.vec(), m.vec());
  EXPECT_EQ(m2_r.vec(), m.vec());
  Guarded<double> x(5), x_r(5);
  for (int64_t e = 0; e < 5; ++e) x[e] = x_r[e] = 1.0 + e;
  ops::divide_in_place(cpu_exec(), x.data(), 3.0, 5);
  ops::divide_in_place_ref(x_r.data(), 3.0, 5);
  EXPECT_EQ(x.vec(), x_r.vec());
  for (auto* g : {&sum, &sum_r, &m, &m_r, &m2, &m2_r, &x, &x_r}) EXPECT_TRUE(g->intact());
}

TEST(RouterBalance, QuantileEstimateMatchesRef) {
  struct Case {
    int64_t T, E, K;
  };
  for (auto c : {Case{4, 4, 1}, Case{16, 8, 2}, Case{21, 7, 3}, Case{6, 3, 2}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K);
    ASSERT_EQ(c.T * c.K % c.E, 0);
    auto l = random_vec<double>(c.T * c.E, 2, -2, 2);
    auto keyv = random_vec<double>(c.T * (c.K + 1), 3, -1, 1);
    Guarded<double> b(c.E), b_r(c.E), col(c.T);
    for (int64_t e = 0; e < c.E; ++e) b[e] = b_r[e] = 0.0;  // += onto zeros: b is the estimate
    ops::quantile_beta_estimate(cpu_exec(), b.data(), col.data(), l.data(), keyv.data(), c.T, c.E,
                                c.K);
    ops::quantile_beta_estimate_ref(b_r.data(), l.data(), keyv.data(), c.T, c.E, c.K);
    EXPECT_EQ(b.vec(), b_r.vec());
    EXPECT_TRUE(b.intact() && b_r.intact() && col.intact());
    // Exactly T K / E entries of column e of (l - alpha) lie above the estimate.
    const int64_t C = c.T * c.K / c.E;
    for (int64_t e = 0; e < c.E; ++e) {
      const double beta = b[e];
      int64_t above = 0;
      for (int64_t t = 0; t < c.T; ++t) above += l[t * c.E + e] - keyv[t * (c.K + 1) + c.K] > beta;
      EXPECT_EQ(above, C) << "expert " << e;
    }
  }
  // K = E would read past the T values of a column: both paths refuse it, as they refuse T K
  // not divisible by E.
  std::vector<double> l(4, 0.0), keyv(8, 0.0), b(2, 0.0), col(2);
  EXPECT_THROW(ops::quantile_beta_estimate(cpu_exec(), b.data(), col.data(), l.data(),
                                           keyv.data(), 2, 2, 2),
               Error);
  EXPECT_THROW(ops::quantile_beta_estimate_ref(b.data(), l.data(), keyv.data(), 2, 2, 2), Error);
  EXPECT_THROW(ops::quantile_beta_estimate_ref(b.data(), l.data(), keyv.data(), 3, 2, 1), Error);
}

TEST(RouterBalance, ExpertBiasUpdate) {
  const std::vector<double> c = {10, 2, 6, 6, 1};  // mean 5
  Guarded<float> b(5), b_r(5);
  for (int64_t e = 0; e < 5; ++e) b[e] = b_r[e] = 0.01f * static_cast<float>(e);
  ops::expert_bias_update(cpu_exec(), b.data(), c.data(), 1e-3f, 5);
  ops::expert_bias_update_ref(b_r.data(), c.data(), 1e-3f, 5);
  EXPECT_EQ(b.vec(), b_r.vec());
  EXPECT_EQ(b[0], 0.0f - 1e-3f);     // over-loaded: down
  EXPECT_EQ(b[1], 0.01f + 1e-3f);    // under-loaded: up
  const std::vector<double> same = {4, 4, 4, 4, 4};
  const auto before = b.vec();
  ops::expert_bias_update(cpu_exec(), b.data(), same.data(), 1e-3f, 5);
  EXPECT_EQ(b.vec(), before);  // balanced: unchanged
  EXPECT_TRUE(b.intact() && b_r.intact());
}

TEST(RouterBalance, QuantileBetaUpdate) {
  for (int64_t E : {1, 5, 64}) {
    SCOPED_TRACE(::testing::Message() << "E=" << E);
    auto avg = random_vec<double>(E, 4, -1, 1);
    auto b0 = random_vec<float>(E, 5);
    for (double ema : {0.0, 0.9}) {
      Guarded<float> b(E), b_r(E);
      Guarded<double> work(E);
      for (int64_t e = 0; e < E; ++e) b[e] = b_r[e] = b0[e];
      ops::quantile_beta_update(cpu_exec(), b.data(), work.data(), avg.data(), ema, E);
      ops::quantile_beta_update_ref(b_r.data(), avg.data(), ema, E);
      EXPECT_EQ(b.vec(), b_r.vec());
      EXPECT_TRUE(b.intact() && b_r.intact() && work.intact());
      double mean = 0;
      for (int64_t e = 0; e < E; ++e) mean += b[e];
      EXPECT_NEAR(mean / E, 0.0, 1e-6);  // centred (up to the fp32 rounding of each entry)
    }
  }
}

}  // namespace
}  // namespace moecore::testing
