// The router's balancing kernels (src/ops/cuda/router_balance.cu) in the grid emulator against
// their `_ref` oracles: counts bitwise (totals and per sequence), the quantile estimate bitwise
// (a selection, ties included), the expert-bias update bitwise, the f64 element updates bitwise,
// quantile_beta_update within the fp32 tolerance; the same bytes in every resume order, outputs
// poisoned and guarded.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "emu/emu_testing.h"
#include "ops/router_balance.h"

namespace moecore {
namespace {

using emu_test::append;
using emu_test::bytes_of;
using emu_test::expect_bitwise;
using emu_test::guarded;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

std::vector<int32_t> ids(int64_t n, int64_t E, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& id : v) id = int32_t(int64_t(g() % uint32_t(E + 1)) - 1);  // -1: dropped
  return v;
}

// No tokens, one, odd counts, more slots than a block; B sequences (t mod B), with and without.
TEST(EmuKernelsRouterBalance, CountTokensPerExpert) {
  struct Shape {
    int64_t T, K, E, B;
  };
  for (const Shape s :
       {Shape{0, 2, 3, 1}, Shape{1, 1, 1, 1}, Shape{37, 3, 7, 3}, Shape{300, 2, 9, 4}}) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " K=" + std::to_string(s.K) +
                 " E=" + std::to_string(s.E) + " B=" + std::to_string(s.B));
    const std::vector<int32_t> idx = ids(s.T * s.K, s.E, uint32_t(s.T + s.E));
    std::vector<int64_t> c_ref(static_cast<size_t>(s.E)), sc_ref(static_cast<size_t>(s.B * s.E));
    ops::count_tokens_per_expert_ref(c_ref.data(), sc_ref.data(), idx.data(), s.T, s.K, s.E, s.B);
    for (bool per_seq : {true, false}) {
      Guarded<int64_t> c(s.E), sc(s.B * s.E);
      EXPECT_EQ(order_dependence([&] {
                  c = Guarded<int64_t>(s.E, -7);
                  sc = Guarded<int64_t>(s.B * s.E, -7);
                  ops::cuda::count_tokens_per_expert(nullptr, c.data(),
                                                     per_seq ? sc.data() : nullptr, idx.data(), s.T,
                                                     s.K, s.E, s.B);
                  std::vector<unsigned char> out;
                  append(out, c);
                  append(out, sc);
                  return out;
                }),
                "");
      expect_bitwise(c, c_ref, "counts_E");
      if (per_seq)
        expect_bitwise(sc, sc_ref, "seq_counts_BE");
      else
        expect_bitwise(sc, std::vector<int64_t>(size_t(s.B * s.E), -7), "seq_counts (not asked)");
    }
  }
}

TEST(EmuKernelsRouterBalance, CountAccumulatorsAndMeans) {
  for (int64_t E : {1, 7, 300}) {
    SCOPED_TRACE("E=" + std::to_string(E));
    std::vector<int64_t> counts(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) counts[size_t(e)] = (e * 7919) % 1000;
    const std::vector<double> sum0 = random_vec<double>(E, 91, 0, 5000);
    std::vector<double> sum_ref = sum0, mean_ref(static_cast<size_t>(E)),
                        mean0_ref(static_cast<size_t>(E)), div_ref = sum0;
    ops::accumulate_counts_ref(sum_ref.data(), counts.data(), E);
    ops::running_mean_counts_ref(mean_ref.data(), sum0.data(), counts.data(), 3.0, E);
    ops::running_mean_counts_ref(mean0_ref.data(), sum0.data(), nullptr, 3.0, E);
    ops::divide_in_place_ref(div_ref.data(), 7.0, E);
    Guarded<double> sum(E), mean(E), mean0(E), div(E);
    EXPECT_EQ(order_dependence([&] {
                sum = guarded(sum0);
                div = guarded(sum0);
                mean = Guarded<double>(E, NAN);
                mean0 = Guarded<double>(E, NAN);
                ops::cuda::accumulate_counts(nullptr, sum.data(), counts.data(), E);
                ops::cuda::running_mean_counts(nullptr, mean.data(), sum0.data(), counts.data(),
                                               3.0, E);
                ops::cuda::running_mean_counts(nullptr, mean0.data(), sum0.data(), nullptr, 3.0, E);
                ops::cuda::divide_in_place(nullptr, div.data(), 7.0, E);
                std::vector<unsigned char> out;
                for (const Guarded<double>* g : {&sum, &mean, &mean0, &div}) append(out, *g);
                return out;
              }),
              "");
    expect_bitwise(sum, sum_ref, "accumulate_counts");
    expect_bitwise(mean, mean_ref, "running_mean_counts");
    expect_bitwise(mean0, mean0_ref, "running_mean_counts (counts null)");
    expect_bitwise(div, div_ref, "divide_in_place");
  }
}

// Columns with ties (logits on a coarse grid) and without; T around and over a block.
TEST(EmuKernelsRouterBalance, QuantileBetaEstimateSelectsTheReferenceValue) {
  struct Shape {
    int64_t T, E, K;
    bool ties;
  };
  for (const Shape s : {Shape{3, 3, 1, false}, Shape{10, 5, 2, true}, Shape{40, 8, 3, true},
                        Shape{300, 6, 2, false}, Shape{65, 65, 1, true}}) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " E=" + std::to_string(s.E) +
                 " K=" + std::to_string(s.K) + (s.ties ? " ties" : ""));
    std::vector<double> logits = random_vec<double>(s.T * s.E, 101, -3, 3);
    std::vector<double> keyv = random_vec<double>(s.T * (s.K + 1), 102, -1, 1);
    if (s.ties) {
      for (double& l : logits) l = std::round(l * 2) / 2;
      for (double& k : keyv) k = std::round(k);
    }
    const std::vector<double> beta0 = random_vec<double>(s.E, 103);
    std::vector<double> want = beta0;
    ops::quantile_beta_estimate_ref(want.data(), logits.data(), keyv.data(), s.T, s.E, s.K);
    Guarded<double> beta(s.E), col(s.T);
    EXPECT_EQ(order_dependence([&] {
                beta = guarded(beta0);
                col = Guarded<double>(s.T, NAN);
                ops::cuda::quantile_beta_estimate(nullptr, beta.data(), col.data(), logits.data(),
                                                  keyv.data(), s.T, s.E, s.K);
                return bytes_of(beta.data(), size_t(s.E));
              }),
              "");
    expect_bitwise(beta, want, "beta_sum_E");
    EXPECT_TRUE(col.intact()) << "col_T";
  }
  Guarded<double> b(4), col(2);
  std::vector<double> l(8), k(4);
  try {
    ops::cuda::quantile_beta_estimate(nullptr, b.data(), col.data(), l.data(), k.data(), 2, 4, 3);
    FAIL() << "T K not divisible by E accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("K=3 E=4 T=2"), std::string::npos) << e.what();
  }
}

TEST(EmuKernelsRouterBalance, OncePerStepUpdates) {
  for (int64_t E : {1, 7, 300}) {
    SCOPED_TRACE("E=" + std::to_string(E));
    const std::vector<float> beta0 = random_vec<float>(E, 111);
    const std::vector<double> avg = random_vec<double>(E, 112);
    // Counts with the mean among them (sign 0) and on both sides of it.
    std::vector<double> counts(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) counts[size_t(e)] = double((e % 3) * 10);
    std::vector<float> beta_ref = beta0, bias_ref = beta0;
    ops::quantile_beta_update_ref(beta_ref.data(), avg.data(), 0.9, E);
    ops::expert_bias_update_ref(bias_ref.data(), counts.data(), 1e-3f, E);
    Guarded<float> beta(E), bias(E);
    Guarded<double> work(E);
    EXPECT_EQ(order_dependence([&] {
                beta = guarded(beta0);
                bias = guarded(beta0);
                work = Guarded<double>(E, NAN);
                ops::cuda::quantile_beta_update(nullptr, beta.data(), work.data(), avg.data(), 0.9,
                                                E);
                ops::cuda::expert_bias_update(nullptr, bias.data(), counts.data(), 1e-3f, E);
                std::vector<unsigned char> out;
                append(out, beta);
                append(out, bias);
                return out;
              }),
              "");
    EXPECT_TRUE(beta.intact() && work.intact());
    for (int64_t e = 0; e < E; ++e) {
      ASSERT_NEAR(beta[e], beta_ref[size_t(e)],
                  kAtol<float> + kRtol<float> * std::abs(beta_ref[size_t(e)]))
          << "quantile_beta_update " << e;
    }
    expect_bitwise(bias, bias_ref, "expert_bias_update");
  }
}

}  // namespace
}  // namespace moecore
