// Router losses: values fast == reference (within f64 rounding: the reference sums in another
// order), uniform routing gives exactly 1.0, and fp64 finite differences of every gradient
// (aux, seq_aux with B = 1 and B > 1, the running-mean counts of global_aux_loss, z).
#include <cmath>
#include <numeric>
#include <vector>

#include "common/testing.h"
#include "ops/router_losses.h"
#include "ops/router_scores.h"

namespace moecore::testing {
namespace {

std::vector<int64_t> random_counts(int64_t n, int64_t hi, uint32_t seed) {
  auto u = random_vec<double>(n, seed, 0, static_cast<double>(hi));
  std::vector<int64_t> c(n);
  for (int64_t i = 0; i < n; ++i) c[i] = static_cast<int64_t>(u[i]);
  return c;
}

struct Case {
  int64_t T, E, K, B;
};
const Case kCases[] = {{1, 1, 1, 1}, {12, 8, 2, 3}, {14, 7, 7, 2}, {40, 13, 1, 4}, {6, 64, 8, 1}};

TEST(RouterLosses, ValuesMatchRef) {
  for (auto c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K);
    auto l = random_vec<double>(c.T * c.E, 1, -3, 3);
    std::vector<double> s(c.T * c.E), a(c.T * c.E);
    ops::router_scores_ref(ops::ScoreFn::Softmax, s.data(), a.data(), l.data(), c.T, c.E);
    auto counts = random_counts(c.E, c.T, 2);
    auto seq = random_counts(c.B * c.E, c.T / c.B + 1, 3);
    std::vector<double> mean(c.E);
    for (int64_t e = 0; e < c.E; ++e) mean[e] = counts[e] * 0.75;
    Guarded<double> v(4), v_r(4), lse(c.T), lse_r(c.T);
    ops::aux_loss_value<long int>(cpu_exec(), &v[0], a.data(), counts.data(), c.T, c.E, c.K);
    ops::aux_loss_value_ref(&v_r[0], a.data(), counts.data(), c.T, c.E, c.K);
    ops::aux_loss_value<double>(cpu_exec(), &v[1], a.data(), mean.data(), c.T, c.E, c.K);
    ops::aux_loss_value_ref(&v_r[1], a.data(), mean.data(), c.T, c.E, c.K);
    ops::seq_aux_loss_value(cpu_exec(), &v[2], a.data(), seq.data(), c.T, c.E, c.K, c.B);
    ops::seq_aux_loss_value_ref(&v_r[2], a.data(), seq.data(), c.T, c.E, c.K, c.B);
    ops::z_loss_value(cpu_exec(), &v[3], lse.data(), l.data(), c.T, c.E);
    ops::z_loss_value_ref(&v_r[3], lse_r.data(), l.data(), c.T, c.E);
    EXPECT_TRUE(all_close(v.vec(), v_r.vec(), kF64Rtol, kF64Atol));
    EXPECT_TRUE(all_close(lse.vec(), lse_r.vec(), kF64Rtol, kF64Atol));
    for (auto* g : {&v, &v_r, &lse, &lse_r}) EXPECT_TRUE(g->intact());
  }
  double z = -1;
  ops::z_loss_value(cpu_exec(), &z, nullptr, nullptr, 0, 4);
  EXPECT_EQ(z, 0.0);  // no tokens
}

TEST(RouterLosses, UniformRoutingIsExactlyOne) {
  // T = 8 tokens, E = 4, K = 2: a = 1/4 everywhere, every expert gets T K / E = 4 pairs.
  const int64_t T = 8, E = 4, K = 2, B = 2;
  std::vector<double> a(T * E, 0.25);
  std::vector<int64_t> counts(E, 4), seq(B * E, 2);
  std::vector<double> mean(E, 4.0);
  double v[3];
  ops::aux_loss_value<long int>(cpu_exec(), &v[0], a.data(), counts.data(), T, E, K);
  ops::aux_loss_value<double>(cpu_exec(), &v[1], a.data(), mean.data(), T, E, K);
  ops::seq_aux_loss_value(cpu_exec(), &v[2], a.data(), seq.data(), T, E, K, B);
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[1], 1.0);
  EXPECT_EQ(v[2], 1.0);
}

// coeff * value as a function of the aux scores a [T, E] (counts held fixed).
template <bool kFast>
void gradcheck(Case c) {
  SCOPED_TRACE(::testing::Message() << (kFast ? "fast" : "ref") << " T=" << c.T << " E=" << c.E
                                    << " K=" << c.K << " B=" << c.B);
  auto a = random_vec<double>(c.T * c.E, 4, 0, 1);
  auto l = random_vec<double>(c.T * c.E, 5, -3, 3);
  auto counts = random_counts(c.E, c.T, 6);
  auto seq = random_counts(c.B * c.E, c.T / c.B + 1, 7);
  std::vector<double> mean(c.E);
  for (int64_t e = 0; e < c.E; ++e) mean[e] = counts[e] / 3.0;
  const double coeff = 0.7, k_over = static_cast<double>(c.E) / c.K;
  auto start = [&] { return random_vec<double>(c.T * c.E, 8); };  // grads accumulate
  auto grad_of = [&](auto&& add) {
    auto g = start();
    const auto g0 = g;
    add(g.data());
    for (size_t i = 0; i < g.size(); ++i) g[i] -= g0[i];
    return g;
  };
  {
    auto loss = [&] {
      double v;
      ops::aux_loss_value_ref(&v, a.data(), counts.data(), c.T, c.E, c.K);
      return coeff * v;
    };
    auto g = grad_of([&](double* d) {
      if (kFast)
        ops::aux_loss_grad<long int>(cpu_exec(), d, counts.data(), coeff * k_over, c.T, c.E);
      else
        ops::aux_loss_grad_ref(d, counts.data(), coeff * k_over, c.T, c.E);
    });
    EXPECT_TRUE(check_gradient(loss, a.data(), g.data(), {c.T, c.E}, "aux da"));
  }
  {
    auto loss = [&] {
      double v;
      ops::aux_loss_value_ref(&v, a.data(), mean.data(), c.T, c.E, c.K);
      return coeff * v;
    };
    auto g = grad_of([&](double* d) {
      if (kFast)
        ops::aux_loss_grad<double>(cpu_exec(), d, mean.data(), coeff * k_over, c.T, c.E);
      else
        ops::aux_loss_grad_ref(d, mean.data(), coeff * k_over, c.T, c.E);
    });
    EXPECT_TRUE(check_gradient(loss, a.data(), g.data(), {c.T, c.E}, "global aux da"));
  }
  {
    auto loss = [&] {
      double v;
      ops::seq_aux_loss_value_ref(&v, a.data(), seq.data(), c.T, c.E, c.K, c.B);
      return coeff * v;
    };
    auto g = grad_of([&](double* d) {
      if (kFast) ops::seq_aux_loss_grad(cpu_exec(), d, seq.data(), coeff * k_over, c.T, c.E, c.B);
      else ops::seq_aux_loss_grad_ref(d, seq.data(), coeff * k_over, c.T, c.E, c.B);
    });
    EXPECT_TRUE(check_gradient(loss, a.data(), g.data(), {c.T, c.E}, "seq aux da"));
  }
  {
    std::vector<double> lse(c.T), sm(c.T * c.E);
    auto loss = [&] {
      double v;
      ops::z_loss_value_ref(&v, lse.data(), l.data(), c.T, c.E);
      return coeff * v;
    };
    loss();
    ops::router_scores_ref(ops::ScoreFn::Softmax, sm.data(), nullptr, l.data(), c.T, c.E);
    const double zc = coeff * 2.0 / static_cast<double>(c.T);
    auto g = grad_of([&](double* d) {
      if (kFast) ops::z_loss_grad(cpu_exec(), d, lse.data(), sm.data(), zc, c.T, c.E);
      else ops::z_loss_grad_ref(d, lse.data(), sm.data(), zc, c.T, c.E);
    });
    EXPECT_TRUE(check_gradient(loss, l.data(), g.data(), {c.T, c.E}, "z dlogits"));
  }
}

TEST(RouterLosses, GradientsMatchFiniteDifferences) {
  for (auto c : kCases) {
    gradcheck<true>(c);
    gradcheck<false>(c);
  }
}

TEST(RouterLosses, GradientsFastMatchRef) {
  for (auto c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " B=" << c.B);
    auto counts = random_counts(c.E, c.T, 9);
    auto seq = random_counts(c.B * c.E, c.T, 10);
    auto lse = random_vec<double>(c.T, 11, 0, 3);
    auto sm = random_vec<double>(c.T * c.E, 12, 0, 1);
    auto d0 = random_vec<double>(c.T * c.E, 13);
    Guarded<double> d(c.T * c.E), d_r(c.T * c.E);
    for (int64_t i = 0; i < c.T * c.E; ++i) d[i] = d_r[i] = d0[i];
    ops::aux_loss_grad<long int>(cpu_exec(), d.data(), counts.data(), 0.3, c.T, c.E);
    ops::aux_loss_grad_ref(d_r.data(), counts.data(), 0.3, c.T, c.E);
    ops::seq_aux_loss_grad(cpu_exec(), d.data(), seq.data(), 0.2, c.T, c.E, c.B);
    ops::seq_aux_loss_grad_ref(d_r.data(), seq.data(), 0.2, c.T, c.E, c.B);
    ops::z_loss_grad(cpu_exec(), d.data(), lse.data(), sm.data(), 0.1, c.T, c.E);
    ops::z_loss_grad_ref(d_r.data(), lse.data(), sm.data(), 0.1, c.T, c.E);
    EXPECT_TRUE(all_close(d.vec(), d_r.vec(), kF64Rtol, kF64Atol));
    EXPECT_TRUE(d.intact() && d_r.intact());
  }
}

}  // namespace
}  // namespace moecore::testing
