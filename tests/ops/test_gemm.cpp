// GEMM, linear and grouped GEMM: the f32 fast path vs plain loops on awkward shapes (1, 7, 13,
// empty; all transposes; padded leading dims; alpha/beta), guard bytes around every output; the
// f64 GEMM (no fast path: it runs the loops) and the loops themselves against a closed-form
// product (common/gemm_oracle.h); grouped == per-group loop with empty groups, wgrad
// accumulation, and linear_backward vs fp64 finite differences.
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/gemm_oracle.h"
#include "common/testing.h"
#include "core/check.h"
#include "ops/gemm.h"

namespace moecore::ops {
namespace {

using moecore::testing::all_close;
using moecore::testing::check_gradient;
using moecore::testing::GemmOracle;
using moecore::testing::Guarded;
using moecore::testing::kF32Atol;
using moecore::testing::kF32Rtol;
using moecore::testing::kF64Atol;
using moecore::testing::kF64Rtol;
using moecore::testing::random_vec;

template <typename T>
void fill(Guarded<T>& g, const std::vector<T>& v) {
  ASSERT_EQ(g.size(), static_cast<int64_t>(v.size()));
  std::copy(v.begin(), v.end(), g.data());
}

// One fast-vs-reference GEMM with padded leading dimensions; A, B, C all guarded.
template <typename T>
void check_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, T beta, int64_t pad,
                uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K
               << " alpha=" << alpha << " beta=" << beta << " pad=" << pad);
  int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
  int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
  int64_t lda = std::max<int64_t>(1, a_cols + pad), ldb = std::max<int64_t>(1, b_cols + pad);
  int64_t ldc = std::max<int64_t>(1, N + pad);
  Guarded<T> a(a_rows * lda), b(b_rows * ldb), c_fast(M * ldc), c_ref(M * ldc);
  fill(a, random_vec<T>(a.size(), seed));
  fill(b, random_vec<T>(b.size(), seed + 1));
  fill(c_fast, random_vec<T>(c_fast.size(), seed + 2));
  std::copy(c_fast.data(), c_fast.data() + c_fast.size(), c_ref.data());
  gemm<T>(cpu_exec(), ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c_fast.data(),
          ldc);
  gemm_ref<T>(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c_ref.data(), ldc);
  EXPECT_TRUE(a.intact() && b.intact()) << "inputs' guards written";
  EXPECT_TRUE(c_fast.intact()) << "gemm wrote outside C";
  EXPECT_TRUE(c_ref.intact()) << "gemm_ref wrote outside C";
  double rtol = std::is_same_v<T, float> ? kF32Rtol : kF64Rtol;
  double atol = std::is_same_v<T, float> ? kF32Atol : kF64Atol;
  // Compares the padding columns too: neither path may touch them.
  EXPECT_TRUE(all_close(c_fast.data(), c_ref.data(), c_fast.size(), rtol, atol));
}

TEST(Gemm, FastMatchesReferenceAllTransposesAwkwardShapes) {
  uint32_t seed = 10;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (int64_t M : {1, 7, 13}) {
        for (int64_t N : {1, 7, 13}) {
          for (int64_t K : {1, 7, 13}) check_gemm<float>(ta, tb, M, N, K, 1.f, 0.f, 0, seed++);
        }
      }
      check_gemm<float>(ta, tb, 33, 65, 130, 1.f, 0.f, 0, seed++);
    }
  }
}

TEST(Gemm, PaddedLeadingDimsAlphaBeta) {
  uint32_t seed = 100;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      check_gemm<float>(ta, tb, 13, 7, 29, 0.5f, -1.5f, 3, seed++);
      check_gemm<float>(ta, tb, 7, 13, 1, -2.0f, 1.0f, 5, seed++);
      check_gemm<float>(ta, tb, 1, 1, 13, 1.0f, 0.25f, 1, seed++);
    }
  }
}

// One GEMM of the closed-form oracle into a guarded C: every element, padding included, equals
// the closed form exactly (small integers: no rounding in any order).
template <typename T, typename Gemm>
void expect_oracle(const GemmOracle<T>& g, const char* who, Gemm&& run) {
  SCOPED_TRACE(::testing::Message() << who << " ta=" << g.ta << " tb=" << g.tb << " M=" << g.M
                                    << " N=" << g.N << " K=" << g.K << " alpha=" << g.alpha
                                    << " beta=" << g.beta << " ldc=" << g.ldc);
  Guarded<T> c(static_cast<int64_t>(g.c0.size()));
  fill(c, g.c0);
  run(g, c.data());
  EXPECT_TRUE(c.intact()) << "wrote outside C";
  for (int64_t i = 0; i < c.size(); ++i) {
    if (!(c[i] == g.want[i])) {
      ADD_FAILURE() << "C[" << i / g.ldc << "," << i % g.ldc << "] = " << c[i] << ", closed form "
                    << g.want[i];
      return;
    }
  }
}

// f64 has no fast path (ops::gemm<double> runs gemm_ref: it serves gradient checks on tiny
// shapes), so comparing it with gemm_ref would compare the loops with themselves: the f64
// dispatch and the loops (both dtypes; the f32 fast path is checked against them above) are
// checked against the closed form instead.
template <typename T>
void check_against_closed_form() {
  moecore::testing::for_each_gemm_oracle<T>([](const GemmOracle<T>& g) {
    expect_oracle(g, "gemm", [](const GemmOracle<T>& o, T* c) {
      gemm<T>(cpu_exec(), o.ta, o.tb, o.M, o.N, o.K, o.alpha, o.a.data(), o.lda, o.b.data(), o.ldb,
              o.beta, c, o.ldc);
    });
    expect_oracle(g, "gemm_ref", [](const GemmOracle<T>& o, T* c) {
      gemm_ref<T>(o.ta, o.tb, o.M, o.N, o.K, o.alpha, o.a.data(), o.lda, o.b.data(), o.ldb,
                  o.beta, c, o.ldc);
    });
  });
}

TEST(Gemm, F64AndReferenceLoopsEqualTheClosedForm) {
  check_against_closed_form<double>();
}

TEST(Gemm, F32AndReferenceLoopsEqualTheClosedForm) {
  check_against_closed_form<float>();
}

TEST(Gemm, EmptyDimensions) {
  // M == 0 or N == 0: nothing to compute, and the guards (C itself has no elements) stay intact.
  check_gemm<float>(false, false, 0, 7, 13, 1.f, 0.5f, 0, 1);
  check_gemm<float>(true, true, 7, 0, 13, 1.f, 0.5f, 0, 2);
  // K == 0: the product is the zero matrix, so C = beta * C, and beta == 0 zeroes C.
  for (float beta : {0.f, 0.5f, 1.f}) {
    Guarded<float> c(7 * 5, 3.f);
    float dummy = 0.f;
    gemm<float>(cpu_exec(), false, false, 7, 5, 0, 1.f, &dummy, 1, &dummy, 5, beta, c.data(), 5);
    EXPECT_TRUE(c.intact());
    for (int64_t i = 0; i < c.size(); ++i) ASSERT_EQ(c[i], 3.f * beta) << "beta=" << beta;
  }
}

TEST(Gemm, BetaZeroIgnoresGarbageInC) {
  // BLAS convention the callers rely on: with beta == 0, uninitialised C (even NaN) is not read.
  auto a = random_vec<float>(7 * 13, 1), b = random_vec<float>(13 * 5, 2);
  Guarded<float> c(7 * 5, NAN), c_ref(7 * 5, NAN);
  gemm<float>(cpu_exec(), false, false, 7, 5, 13, 1.f, a.data(), 13, b.data(), 5, 0.f, c.data(), 5);
  gemm_ref<float>(false, false, 7, 5, 13, 1.f, a.data(), 13, b.data(), 5, 0.f, c_ref.data(), 5);
  for (int64_t i = 0; i < c.size(); ++i) ASSERT_FALSE(std::isnan(c[i])) << i;
  EXPECT_TRUE(all_close(c.data(), c_ref.data(), c.size(), kF32Rtol, kF32Atol));
}

TEST(Gemm, ShortLeadingDimensionIsAnError) {
  std::vector<float> a(7 * 13), b(13 * 5), c(7 * 5);
  EXPECT_THROW(gemm<float>(cpu_exec(), false, false, 7, 5, 13, 1.f, a.data(), 12, b.data(), 5, 0.f,
                           c.data(), 5),
               moecore::Error);
  EXPECT_THROW(gemm<float>(cpu_exec(), false, true, 7, 5, 13, 1.f, a.data(), 13, b.data(), 5, 0.f,
                           c.data(), 5),
               moecore::Error);
  EXPECT_THROW(gemm<float>(cpu_exec(), false, false, 7, 5, 13, 1.f, a.data(), 13, b.data(), 5, 0.f,
                           c.data(), 4),
               moecore::Error);
}

TEST(Gemm, SmallIntegerInputsAreExact) {
  // Small integers: every product and partial sum is exact in f32, so any summation order gives
  // the same answer and fast must equal reference bitwise.
  const int64_t M = 13, N = 7, K = 29;
  std::vector<float> a(M * K), b(K * N), c(M * N), c_ref(M * N);
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>(i % 7 - 3);
  for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<float>(i % 5 - 2);
  gemm<float>(cpu_exec(), false, false, M, N, K, 1.f, a.data(), K, b.data(), N, 0.f, c.data(), N);
  gemm_ref<float>(false, false, M, N, K, 1.f, a.data(), K, b.data(), N, 0.f, c_ref.data(), N);
  EXPECT_EQ(0, std::memcmp(c.data(), c_ref.data(), c.size() * sizeof(float)));
}

TEST(Linear, ForwardMatchesGemmAndAccumulates) {
  const int64_t M = 13, N = 7, K = 29;
  auto x = random_vec<float>(M * K, 1), w = random_vec<float>(N * K, 2);
  Guarded<float> y(M * N, 0.f);
  std::vector<float> y_ref(M * N);
  linear_forward<float>(cpu_exec(), y.data(), x.data(), w.data(), M, N, K);
  gemm_ref<float>(false, true, M, N, K, 1.f, x.data(), K, w.data(), K, 0.f, y_ref.data(), N);
  EXPECT_TRUE(y.intact());
  EXPECT_TRUE(all_close(y.data(), y_ref.data(), M * N, kF32Rtol, kF32Atol));
  linear_forward<float>(cpu_exec(), y.data(), x.data(), w.data(), M, N, K, /*accumulate=*/true);
  for (auto& v : y_ref) v *= 2.f;
  EXPECT_TRUE(all_close(y.data(), y_ref.data(), M * N, kF32Rtol, kF32Atol));
}

TEST(Linear, BackwardMatchesReferenceAndAccumulates) {
  const int64_t M = 7, N = 13, K = 5;
  auto x = random_vec<float>(M * K, 1), w = random_vec<float>(N * K, 2);
  auto dy = random_vec<float>(M * N, 3);
  auto dx0 = random_vec<float>(M * K, 4), dw0 = random_vec<float>(N * K, 5);
  for (bool acc_dx : {false, true}) {
    Guarded<float> dx(M * K), dw(N * K);
    fill(dx, dx0);
    fill(dw, dw0);
    linear_backward<float>(cpu_exec(), dx.data(), dw.data(), dy.data(), x.data(), w.data(), M, N, K,
                           acc_dx);
    std::vector<float> dx_ref = dx0, dw_ref = dw0;
    gemm_ref<float>(false, false, M, K, N, 1.f, dy.data(), N, w.data(), K, acc_dx ? 1.f : 0.f,
                    dx_ref.data(), K);
    gemm_ref<float>(true, false, N, K, M, 1.f, dy.data(), N, x.data(), K, 1.f, dw_ref.data(), K);
    EXPECT_TRUE(dx.intact() && dw.intact());
    EXPECT_TRUE(all_close(dx.vec(), dx_ref, kF32Rtol, kF32Atol)) << "dx, accumulate=" << acc_dx;
    EXPECT_TRUE(all_close(dw.vec(), dw_ref, kF32Rtol, kF32Atol)) << "dw always accumulates";
  }
  // A null dx skips the data gradient (first layer) but still accumulates dw.
  std::vector<float> dw = dw0, dw_ref = dw0;
  linear_backward<float>(cpu_exec(), nullptr, dw.data(), dy.data(), x.data(), w.data(), M, N, K);
  gemm_ref<float>(true, false, N, K, M, 1.f, dy.data(), N, x.data(), K, 1.f, dw_ref.data(), K);
  EXPECT_TRUE(all_close(dw, dw_ref, kF32Rtol, kF32Atol));
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  // loss = sum(y * r), y = x w^T, so dloss/dy = r.
  const int64_t M = 5, N = 7, K = 3;
  auto x = random_vec<double>(M * K, 11), w = random_vec<double>(N * K, 12);
  auto r = random_vec<double>(M * N, 13);
  auto loss = [&] {
    std::vector<double> y(M * N);
    linear_forward<double>(cpu_exec(), y.data(), x.data(), w.data(), M, N, K);
    double s = 0;
    for (int64_t i = 0; i < M * N; ++i) s += y[i] * r[i];
    return s;
  };
  std::vector<double> dx(M * K, 0.0), dw(N * K, 0.0);
  linear_backward<double>(cpu_exec(), dx.data(), dw.data(), r.data(), x.data(), w.data(), M, N, K);
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), {M, K}, "dx", 64));
  EXPECT_TRUE(check_gradient(loss, w.data(), dw.data(), {N, K}, "dw", 64));
}

// Grouped GEMM cases: empty groups first, last, in the middle; everything in one group; G = 1.
const std::vector<std::vector<int64_t>> kGroupCases = {
    {0, 5, 0, 3}, {0, 0, 7}, {7, 0, 0}, {0, 9, 0}, {6}, {0}, {3, 1, 4, 1, 5, 9, 2, 6}, {13, 13},
};

template <typename T>
void check_grouped(const std::vector<int64_t>& m_G, bool trans_w, int64_t N, int64_t K,
                   uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "G=" << m_G.size() << " m0=" << m_G[0] << " trans_w=" << trans_w);
  const int64_t G = static_cast<int64_t>(m_G.size());
  const int64_t rows = std::accumulate(m_G.begin(), m_G.end(), int64_t{0});
  auto x = random_vec<T>(rows * K, seed), w = random_vec<T>(G * N * K, seed + 1);
  Guarded<T> y(rows * N, T(7)), y_ref(rows * N, T(7)), y_loop(rows * N, T(7));
  grouped_gemm<T>(cpu_exec(), m_G.data(), G, N, K, x.data(), w.data(), trans_w, y.data());
  grouped_gemm_ref<T>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, y_ref.data());
  // Megatron's check: grouped == a loop of per-expert GEMMs.
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    gemm<T>(cpu_exec(), false, trans_w, m_G[g], N, K, T(1), x.data() + row0 * K, K,
            w.data() + g * N * K, trans_w ? K : N, T(0), y_loop.data() + row0 * N, N);
    row0 += m_G[g];
  }
  EXPECT_TRUE(y.intact() && y_ref.intact() && y_loop.intact());
  double rtol = std::is_same_v<T, float> ? kF32Rtol : kF64Rtol;
  double atol = std::is_same_v<T, float> ? kF32Atol : kF64Atol;
  EXPECT_TRUE(all_close(y.vec(), y_ref.vec(), rtol, atol)) << "grouped vs reference";
  EXPECT_TRUE(all_close(y.vec(), y_loop.vec(), rtol, atol)) << "grouped vs per-group loop";

  // Weight gradient accumulates into a non-zero dw; empty groups leave theirs bitwise alone.
  auto dy = random_vec<T>(rows * N, seed + 2), dw0 = random_vec<T>(G * N * K, seed + 3);
  Guarded<T> dw(G * N * K), dw_ref(G * N * K), dw_loop(G * N * K);
  fill(dw, dw0);
  fill(dw_ref, dw0);
  fill(dw_loop, dw0);
  grouped_gemm_wgrad<T>(cpu_exec(), m_G.data(), G, N, K, dy.data(), x.data(), dw.data());
  grouped_gemm_wgrad_ref<T>(m_G.data(), G, N, K, dy.data(), x.data(), dw_ref.data());
  row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    gemm<T>(cpu_exec(), true, false, N, K, m_G[g], T(1), dy.data() + row0 * N, N,
            x.data() + row0 * K, K, T(1), dw_loop.data() + g * N * K, K);
    row0 += m_G[g];
  }
  EXPECT_TRUE(dw.intact() && dw_ref.intact() && dw_loop.intact());
  EXPECT_TRUE(all_close(dw.vec(), dw_ref.vec(), rtol, atol)) << "wgrad vs reference";
  EXPECT_TRUE(all_close(dw.vec(), dw_loop.vec(), rtol, atol)) << "wgrad vs per-group loop";
  for (int64_t g = 0; g < G; ++g) {
    if (m_G[g] != 0) continue;
    EXPECT_EQ(0, std::memcmp(dw.data() + g * N * K, dw0.data() + g * N * K, N * K * sizeof(T)))
        << "empty group " << g << " changed its dw";
  }
}

TEST(GroupedGemm, MatchesReferenceAndPerGroupLoopWithEmptyGroups) {
  uint32_t seed = 200;
  for (const auto& m_G : kGroupCases) {
    for (bool trans_w : {false, true}) {
      check_grouped<float>(m_G, trans_w, 7, 13, seed);
      check_grouped<double>(m_G, trans_w, 5, 3, seed);
      seed += 10;
    }
  }
}

TEST(GroupedGemm, NoGroupsAndNoRows) {
  Guarded<float> y(0), dw(0);
  grouped_gemm<float>(cpu_exec(), nullptr, 0, 7, 13, nullptr, nullptr, true, y.data());
  grouped_gemm_wgrad<float>(cpu_exec(), nullptr, 0, 7, 13, nullptr, nullptr, dw.data());
  EXPECT_TRUE(y.intact() && dw.intact());
}

TEST(GroupedGemm, NegativeCountIsAnError) {
  std::vector<int64_t> m_G = {3, -1};
  std::vector<float> x(3 * 4), w(2 * 5 * 4), y(3 * 5);
  EXPECT_THROW(
      grouped_gemm<float>(cpu_exec(), m_G.data(), 2, 5, 4, x.data(), w.data(), true, y.data()),
      moecore::Error);
}

TEST(GroupedGemm, DeterministicRunToRun) {
  // Balanced groups, so at >= 2 threads this takes the parallel-groups path.
  std::vector<int64_t> m_G = {9, 0, 11, 10, 12};
  const int64_t N = 17, K = 33, rows = 42, G = 5;
  auto x = random_vec<float>(rows * K, 1), w = random_vec<float>(G * N * K, 2);
  auto dy = random_vec<float>(rows * N, 3);
  std::vector<float> y1(rows * N), y2(rows * N), dw1(G * N * K, 0.f), dw2(G * N * K, 0.f);
  grouped_gemm<float>(cpu_exec(), m_G.data(), G, N, K, x.data(), w.data(), true, y1.data());
  grouped_gemm<float>(cpu_exec(), m_G.data(), G, N, K, x.data(), w.data(), true, y2.data());
  grouped_gemm_wgrad<float>(cpu_exec(), m_G.data(), G, N, K, dy.data(), x.data(), dw1.data());
  grouped_gemm_wgrad<float>(cpu_exec(), m_G.data(), G, N, K, dy.data(), x.data(), dw2.data());
  EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dw1.size() * sizeof(float)));
}

}  // namespace
}  // namespace moecore::ops
