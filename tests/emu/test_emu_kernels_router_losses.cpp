// The router loss kernels (src/ops/cuda/router_losses.cu) in the grid emulator against their
// references within the f64 tolerance (docs/numerics.md: another summation order, the device's
// exp and log): each value into a NaN-poisoned guarded slot, z-loss's logsumexps too, the
// gradients accumulating onto random values; bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/router_losses.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

struct LossCase {
  int64_t T, E, K, B;
};
// One token and expert; K = E; E not a multiple of 8; more elements than the value block's 1024
// threads (several per thread, a partial last stride) and more than a grid-stride block's 256.
const LossCase kCases[] = {{1, 1, 1, 1},   {12, 8, 2, 3}, {14, 7, 7, 2},
                           {40, 13, 1, 4}, {6, 64, 8, 1}, {300, 13, 2, 4}};

std::vector<int64_t> random_counts(int64_t n, int64_t hi, uint32_t seed) {
  const auto u = random_vec<double>(n, seed, 0, static_cast<double>(hi));
  std::vector<int64_t> c(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) c[size_t(i)] = static_cast<int64_t>(u[size_t(i)]);  // zeros too
  return c;
}

// The aux-loss scores of softmax routing: the softmax of each row of logits [T, E]
// (router_scores_ref's, written out here: the sanitizer build links each kernel's own reference
// only).
void softmax_rows(double* s_TE, const double* l_TE, int64_t T, int64_t E) {
  for (int64_t t = 0; t < T; ++t) {
    const double* l = l_TE + t * E;
    double m = -INFINITY, z = 0;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
    for (int64_t e = 0; e < E; ++e) s_TE[t * E + e] = std::exp(l[e] - m) / z;
  }
}

void expect_close(const Guarded<double>& got, const std::vector<double>& want, const char* what) {
  EXPECT_TRUE(got.intact()) << what << " written outside its elements";
  for (int64_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[size_t(i)], kAtol<double> + kRtol<double> * std::abs(want[size_t(i)]))
        << what << " element " << i;
  }
}

// run(out) once per resume order on a fresh NaN-filled guarded buffer of n; the last run's output.
template <typename F>
Guarded<double> in_every_order(int64_t n, const std::vector<double>* init, F run) {
  Guarded<double> out(n, NAN);
  EXPECT_EQ(order_dependence([&] {
              Guarded<double> o(n, NAN);
              if (init) {
                for (int64_t i = 0; i < n; ++i) o[i] = (*init)[size_t(i)];
              }
              run(o.data());
              out = o;
              return bytes_of(o.data(), size_t(n));
            }),
            "");
  return out;
}

TEST(EmuKernelsRouterLosses, ValuesMatchTheReferenceInEveryOrder) {
  uint32_t seed = 600;
  for (const LossCase c : kCases) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) +
                 " K=" + std::to_string(c.K) + " B=" + std::to_string(c.B));
    const auto l = random_vec<double>(c.T * c.E, seed++, -3, 3);
    std::vector<double> a(static_cast<size_t>(c.T * c.E));
    softmax_rows(a.data(), l.data(), c.T, c.E);
    const auto counts = random_counts(c.E, c.T, seed++);
    const auto seq = random_counts(c.B * c.E, c.T / c.B + 1, seed++);
    std::vector<double> mean(static_cast<size_t>(c.E));
    for (int64_t e = 0; e < c.E; ++e) mean[size_t(e)] = double(counts[size_t(e)]) * 0.75;
    std::vector<double> want(4), lse_want(static_cast<size_t>(c.T));
    ops::aux_loss_value_ref(&want[0], a.data(), counts.data(), c.T, c.E, c.K);
    ops::aux_loss_value_ref(&want[1], a.data(), mean.data(), c.T, c.E, c.K);
    ops::seq_aux_loss_value_ref(&want[2], a.data(), seq.data(), c.T, c.E, c.K, c.B);
    ops::z_loss_value_ref(&want[3], lse_want.data(), l.data(), c.T, c.E);
    const auto v0 = in_every_order(1, nullptr, [&](double* v) {
      ops::cuda::aux_loss_value<int64_t>(nullptr, v, a.data(), counts.data(), c.T, c.E, c.K);
    });
    const auto v1 = in_every_order(1, nullptr, [&](double* v) {
      ops::cuda::aux_loss_value<double>(nullptr, v, a.data(), mean.data(), c.T, c.E, c.K);
    });
    const auto v2 = in_every_order(1, nullptr, [&](double* v) {
      ops::cuda::seq_aux_loss_value(nullptr, v, a.data(), seq.data(), c.T, c.E, c.K, c.B);
    });
    Guarded<double> lse(c.T, NAN);
    const auto v3 = in_every_order(1, nullptr, [&](double* v) {
      Guarded<double> lse1(c.T, NAN);
      ops::cuda::z_loss_value(nullptr, v, lse1.data(), l.data(), c.T, c.E);
      lse = lse1;
    });
    expect_close(v0, {want[0]}, "aux_loss_value, int64 counts");
    expect_close(v1, {want[1]}, "aux_loss_value, running-mean counts");
    expect_close(v2, {want[2]}, "seq_aux_loss_value");
    expect_close(v3, {want[3]}, "z_loss_value");
    expect_close(lse, lse_want, "lse_T");
  }
}

// z-loss of no tokens is exactly 0, written (the slot held NaN).
TEST(EmuKernelsRouterLosses, ZLossOfNoTokensIsZero) {
  Guarded<double> z(1, NAN);
  ops::cuda::z_loss_value(nullptr, z.data(), nullptr, nullptr, 0, 4);
  EXPECT_TRUE(z.intact());
  EXPECT_EQ(bytes_of(z.data(), 1), std::vector<unsigned char>(8, 0));
}

TEST(EmuKernelsRouterLosses, GradsMatchTheReferenceInEveryOrder) {
  uint32_t seed = 620;
  std::vector<LossCase> cases(std::begin(kCases), std::end(kCases));
  cases.push_back({0, 4, 1, 2});  // no tokens: nothing added
  for (const LossCase c : cases) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) +
                 " B=" + std::to_string(c.B));
    const int64_t n = c.T * c.E;
    const auto counts = random_counts(c.E, c.T, seed++);
    std::vector<double> mean(static_cast<size_t>(c.E));
    for (int64_t e = 0; e < c.E; ++e) mean[size_t(e)] = double(counts[size_t(e)]) / 3.0;
    const auto seq = random_counts(c.B * c.E, c.T, seed++);
    const auto lse = random_vec<double>(c.T, seed++, 0, 3);
    const auto sm = random_vec<double>(n, seed++, 0, 1);
    const auto d0 = random_vec<double>(n, seed++);
    std::vector<double> r_aux = d0, r_mean = d0, r_seq = d0, r_z = d0;
    ops::aux_loss_grad_ref(r_aux.data(), counts.data(), 0.3, c.T, c.E);
    ops::aux_loss_grad_ref(r_mean.data(), mean.data(), 0.3, c.T, c.E);
    ops::seq_aux_loss_grad_ref(r_seq.data(), seq.data(), 0.2, c.T, c.E, c.B);
    ops::z_loss_grad_ref(r_z.data(), lse.data(), sm.data(), 0.1, c.T, c.E);
    expect_close(in_every_order(n, &d0,
                                [&](double* g) {
                                  ops::cuda::aux_loss_grad<int64_t>(nullptr, g, counts.data(), 0.3,
                                                                    c.T, c.E);
                                }),
                 r_aux, "aux_loss_grad, int64 counts");
    expect_close(in_every_order(n, &d0,
                                [&](double* g) {
                                  ops::cuda::aux_loss_grad<double>(nullptr, g, mean.data(), 0.3,
                                                                   c.T, c.E);
                                }),
                 r_mean, "aux_loss_grad, running-mean counts");
    expect_close(in_every_order(n, &d0,
                                [&](double* g) {
                                  ops::cuda::seq_aux_loss_grad(nullptr, g, seq.data(), 0.2, c.T,
                                                               c.E, c.B);
                                }),
                 r_seq, "seq_aux_loss_grad");
    expect_close(in_every_order(n, &d0,
                                [&](double* g) {
                                  ops::cuda::z_loss_grad(nullptr, g, lse.data(), sm.data(), 0.1,
                                                         c.T, c.E);
                                }),
                 r_z, "z_loss_grad");
  }
}

TEST(EmuKernelsRouterLosses, BadArgumentsAreErrors) {
  double d = 0;
  int64_t i = 0;
  // The values of no tokens (the router skips them), and sequences that do not divide the tokens.
  EXPECT_THROW(ops::cuda::aux_loss_value<int64_t>(nullptr, &d, &d, &i, 0, 4, 2), Error);
  EXPECT_THROW(ops::cuda::seq_aux_loss_value(nullptr, &d, &d, &i, 0, 4, 2, 1), Error);
  EXPECT_THROW(ops::cuda::seq_aux_loss_value(nullptr, &d, &d, &i, 5, 4, 2, 2), Error);
  EXPECT_THROW(ops::cuda::seq_aux_loss_grad(nullptr, &d, &i, 1.0, 5, 4, 2), Error);
  EXPECT_THROW(ops::cuda::seq_aux_loss_grad(nullptr, &d, &i, 1.0, 4, 4, 0), Error);
  EXPECT_THROW(ops::cuda::z_loss_value(nullptr, &d, &d, &d, 1, 0), Error);
  EXPECT_THROW(ops::cuda::z_loss_grad(nullptr, &d, &d, &d, 1.0, -1, 4), Error);
  EXPECT_THROW(ops::cuda::aux_loss_grad<double>(nullptr, &d, &d, 1.0, 1, 0), Error);
}

}  // namespace
}  // namespace moecore
