// Cases: gemm (f32 against gemm_ref; f32 and f64 against the closed-form product of
// common/gemm_oracle.h, exactly: on the CPU the f64 gemm is gemm_ref itself, so a comparison
// with gemm_ref would prove nothing), linear_forward / linear_backward (against gemm_ref, their
// definition), and the grouped GEMMs (zero-row groups first, last and in the middle, G = 1, row counts not divisible
// by 8, both weight layouts, balanced loads that take the parallel-groups path).
#include <numeric>

#include "backend_case.h"
#include "common/gemm_oracle.h"
#include "ops/gemm.h"

namespace moecore::backend_test {
namespace {

using ops::gemm_ref;

// One GEMM with padded leading dimensions; C starts from `c0` (NaN where beta is 0: not read).
// The padding columns of C are compared too: neither path may write them.
template <typename T>
void one_gemm(const Exec& ex, bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, T beta,
              int64_t pad, uint32_t seed, bool nan_c = false) {
  BACKEND_TRACE("ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N << " K=" << K
                      << " alpha=" << alpha << " beta=" << beta << " pad=" << pad);
  const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
  const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
  const int64_t lda = std::max<int64_t>(1, a_cols + pad), ldb = std::max<int64_t>(1, b_cols + pad);
  const int64_t ldc = std::max<int64_t>(1, N + pad);
  const auto a = random_vec<T>(a_rows * lda, seed), b = random_vec<T>(b_rows * ldb, seed + 1);
  auto c0 = random_vec<T>(M * ldc, seed + 2);
  if (nan_c) {
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) c0[i * ldc + j] = std::numeric_limits<T>::quiet_NaN();
    }
  }
  Guarded<T> c = guarded(c0);
  std::vector<T> c_ref = c0;
  {
    Staging st(ex);
    ops::gemm<T>(ex, ta, tb, M, N, K, alpha, st.in(a), lda, st.in(b), ldb, beta, st.out(c), ldc);
    st.back();
  }
  gemm_ref<T>(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c_ref.data(), ldc);
  expect_close(c, c_ref.data(), "C");
}

template <typename T>
void gemm_transposes(const Exec& ex) {
  uint32_t seed = 10;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (int64_t M : {1, 7, 13}) {
        for (int64_t N : {1, 13}) {
          for (int64_t K : {1, 7, 13}) one_gemm<T>(ex, ta, tb, M, N, K, T(1), T(0), 0, seed++);
        }
      }
      one_gemm<T>(ex, ta, tb, 33, 65, 130, T(1), T(0), 0, seed++);
      one_gemm<T>(ex, ta, tb, 13, 7, 29, T(0.5), T(-1.5), 3, seed++);
      one_gemm<T>(ex, ta, tb, 7, 13, 1, T(-2), T(1), 5, seed++);
    }
  }
}

// The closed form: all transposes, awkward shapes, padded leading dims (A and B padded with NaN,
// C's padding a sentinel), alpha / beta, beta = 0 over NaN; small integers, so exact.
template <typename T>
void gemm_closed_form(const Exec& ex) {
  testing::for_each_gemm_oracle<T>([&](const testing::GemmOracle<T>& g) {
    BACKEND_TRACE("ta=" << g.ta << " tb=" << g.tb << " M=" << g.M << " N=" << g.N << " K=" << g.K
                        << " alpha=" << g.alpha << " beta=" << g.beta << " ldc=" << g.ldc);
    Guarded<T> c = guarded(g.c0);
    Staging st(ex);
    ops::gemm<T>(ex, g.ta, g.tb, g.M, g.N, g.K, g.alpha, st.in(g.a), g.lda, st.in(g.b), g.ldb,
                 g.beta, st.out(c), g.ldc);
    st.back();
    expect_close(c, g.want.data(), "C", 0.0, 0.0);
  });
}

// M = 0, N = 0 (nothing to write), K = 0 (C = beta C), beta = 0 over NaN (C not read), and
// small integers, whose products and sums are exact in any order: bitwise.
void gemm_f32_edges(const Exec& ex) {
  one_gemm<float>(ex, false, false, 0, 7, 13, 1.f, 0.5f, 0, 1);
  one_gemm<float>(ex, true, true, 7, 0, 13, 1.f, 0.5f, 0, 2);
  for (float beta : {0.f, 0.5f, 1.f}) {
    BACKEND_TRACE("K=0 beta=" << beta);
    Guarded<float> c(7 * 5, 3.f);
    std::vector<float> c_ref(7 * 5, 3.f);
    float dummy = 0.f;
    {
      Staging st(ex);
      ops::gemm<float>(ex, false, false, 7, 5, 0, 1.f, st.in(&dummy, 1), 1, st.in(&dummy, 1), 5,
                       beta, st.out(c), 5);
      st.back();
    }
    gemm_ref<float>(false, false, 7, 5, 0, 1.f, &dummy, 1, &dummy, 5, beta, c_ref.data(), 5);
    expect_bitwise(c, c_ref.data(), "C = beta C");
  }
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) one_gemm<float>(ex, ta, tb, 9, 11, 17, 1.f, 0.f, 2, 3, true);
  }
  const int64_t M = 13, N = 7, K = 29;
  std::vector<float> a(M * K), b(K * N);
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>(i % 7 - 3);
  for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<float>(i % 5 - 2);
  Guarded<float> c = nan_out<float>(M * N);
  std::vector<float> c_ref(M * N);
  {
    Staging st(ex);
    ops::gemm<float>(ex, false, false, M, N, K, 1.f, st.in(a), K, st.in(b), N, 0.f, st.out(c), N);
    st.back();
  }
  gemm_ref<float>(false, false, M, N, K, 1.f, a.data(), K, b.data(), N, 0.f, c_ref.data(), N);
  expect_bitwise(c, c_ref.data(), "small integers: exact");
}

// linear_forward: y (+)= x w^T; linear_backward: dx (+)= dy w, dw += dy^T x; dx may be null.
template <typename T>
void linear(const Exec& ex) {
  struct Shape {
    int64_t M, N, K;
  };
  uint32_t seed = 30;
  for (Shape s : {Shape{1, 1, 1}, Shape{13, 7, 29}, Shape{7, 13, 5}, Shape{33, 17, 65}}) {
    const auto [M, N, K] = s;
    const auto x = random_vec<T>(M * K, seed++), w = random_vec<T>(N * K, seed++);
    const auto dy = random_vec<T>(M * N, seed++), y0 = random_vec<T>(M * N, seed++);
    const auto dx0 = random_vec<T>(M * K, seed++), dw0 = random_vec<T>(N * K, seed++);
    for (bool acc : {false, true}) {
      BACKEND_TRACE("M=" << M << " N=" << N << " K=" << K << " accumulate=" << acc);
      Guarded<T> y = acc ? guarded(y0) : nan_out<T>(M * N);
      std::vector<T> y_ref = y0;
      Guarded<T> dx = acc ? guarded(dx0) : nan_out<T>(M * K), dw = guarded(dw0);
      {
        Staging st(ex);
        ops::linear_forward<T>(ex, st.out(y), st.in(x), st.in(w), M, N, K, acc);
        ops::linear_backward<T>(ex, st.out(dx), st.out(dw), st.in(dy), st.in(x), st.in(w), M, N, K,
                                acc);
        st.back();
      }
      gemm_ref<T>(false, true, M, N, K, T(1), x.data(), K, w.data(), K, acc ? T(1) : T(0),
                  y_ref.data(), N);
      expect_close(y, y_ref.data(), "y");

      std::vector<T> dx_ref = dx0, dw_ref = dw0;
      gemm_ref<T>(false, false, M, K, N, T(1), dy.data(), N, w.data(), K, acc ? T(1) : T(0),
                  dx_ref.data(), K);
      gemm_ref<T>(true, false, N, K, M, T(1), dy.data(), N, x.data(), K, T(1), dw_ref.data(), K);
      expect_close(dx, dx_ref.data(), "dx");
      expect_close(dw, dw_ref.data(), "dw (accumulated)");
    }
    BACKEND_TRACE("M=" << M << " N=" << N << " K=" << K << " dx null");
    Guarded<T> dw = guarded(dw0);
    std::vector<T> dw_ref = dw0;
    {
      Staging st(ex);
      ops::linear_backward<T>(ex, nullptr, st.out(dw), st.in(dy), st.in(x), st.in(w), M, N, K);
      st.back();
    }
    gemm_ref<T>(true, false, N, K, M, T(1), dy.data(), N, x.data(), K, T(1), dw_ref.data(), K);
    expect_close(dw, dw_ref.data(), "dw without dx");
  }
}

int64_t total_rows(const std::vector<int64_t>& m_G) {
  return std::accumulate(m_G.begin(), m_G.end(), int64_t{0});
}

// fixed: every group has the same rows and the op is told so (rows_per_group: the CUDA path's
// strided-batched matmul, which reads no size).
template <typename T>
void grouped_forward(const Exec& ex, const std::vector<std::vector<int64_t>>& groups, int64_t N,
                     int64_t K, bool fixed = false) {
  uint32_t seed = 50;
  for (const auto& m_G : groups) {
    const int64_t G = static_cast<int64_t>(m_G.size()), rows = total_rows(m_G);
    const int64_t per_group = fixed ? m_G[0] : 0;
    const auto x = random_vec<T>(rows * K, seed++), w = random_vec<T>(G * N * K, seed++);
    for (bool trans_w : {false, true}) {
      BACKEND_TRACE("G=" << G << " rows=" << rows << " N=" << N << " K=" << K
                         << " trans_w=" << trans_w);
      Guarded<T> y = nan_out<T>(rows * N);
      std::vector<T> y_ref(rows * N);
      {
        Staging st(ex);
        const StagedGroupedWorkspace gws(ex, st, G);
        ops::grouped_gemm<T>(ex, st.in(m_G), G, N, K, st.in(x), st.in(w), trans_w, st.out(y),
                             {gws.data, gws.bytes}, per_group);
        st.back();
      }
      ops::grouped_gemm_ref<T>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, y_ref.data());
      expect_close(y, y_ref.data(), "y");
    }
  }
}

// dw accumulates into a non-zero start; a zero-row group's dw stays bitwise as it was.
template <typename T>
void grouped_wgrad(const Exec& ex, const std::vector<std::vector<int64_t>>& groups, int64_t N,
                   int64_t K, bool fixed = false) {
  uint32_t seed = 70;
  for (const auto& m_G : groups) {
    const int64_t G = static_cast<int64_t>(m_G.size()), rows = total_rows(m_G);
    const int64_t per_group = fixed ? m_G[0] : 0;
    BACKEND_TRACE("G=" << G << " rows=" << rows << " N=" << N << " K=" << K);
    const auto x = random_vec<T>(rows * K, seed++), dy = random_vec<T>(rows * N, seed++);
    const auto dw0 = random_vec<T>(G * N * K, seed++);
    Guarded<T> dw = guarded(dw0);
    std::vector<T> dw_ref = dw0;
    {
      Staging st(ex);
      const StagedGroupedWorkspace gws(ex, st, G);
      ops::grouped_gemm_wgrad<T>(ex, st.in(m_G), G, N, K, st.in(dy), st.in(x), st.out(dw),
                                 {gws.data, gws.bytes}, per_group);
      st.back();
    }
    ops::grouped_gemm_wgrad_ref<T>(m_G.data(), G, N, K, dy.data(), x.data(), dw_ref.data());
    expect_close(dw, dw_ref.data(), "dw");
    for (int64_t g = 0; g < G; ++g) {
      if (m_G[g] == 0) {
        EXPECT_TRUE(same_bits(dw.data() + g * N * K, dw0.data() + g * N * K, N * K))
            << "zero-row group " << g << " changed its dw";
      }
    }
  }
}

// Zero-row groups first, last, in the middle, and every group empty.
const std::vector<std::vector<int64_t>> kEmptyGroups = {{0, 5, 0, 3}, {0, 0, 7}, {7, 0, 0},
                                                        {0, 9, 0},    {0},       {0, 0, 0, 0}};
// G = 1, row counts not divisible by 8 (31 rows over 8 groups), two equal groups, and balanced
// loads with an empty group (the parallel-groups path at >= 2 threads).
const std::vector<std::vector<int64_t>> kUnevenGroups = {
    {6}, {1}, {3, 1, 4, 1, 5, 9, 2, 6}, {13, 13}, {9, 0, 11, 10, 12}};

// Equal groups whose rows the caller states (the dense MLP's one group, padded capacity blocks).
const std::vector<std::vector<int64_t>> kFixedGroups = {{6}, {1}, {13, 13}, {4, 4, 4, 4, 4, 4, 4}};

std::vector<std::vector<int64_t>> all_groups() {
  auto g = kEmptyGroups;
  g.insert(g.end(), kUnevenGroups.begin(), kUnevenGroups.end());
  return g;
}

}  // namespace

void add_gemm_cases(std::vector<OpCase>& out) {
  out.push_back({"gemm_f32_transposes", {"gemm"}, gemm_transposes<float>});
  out.push_back({"gemm_f32_closed_form", {"gemm"}, gemm_closed_form<float>});
  out.push_back({"gemm_f64_closed_form", {"gemm"}, gemm_closed_form<double>});
  out.push_back({"gemm_f32_empty_dims_beta0_exact", {"gemm"}, gemm_f32_edges});
  out.push_back({"linear_f32", {"linear_forward", "linear_backward"}, linear<float>});
  out.push_back({"linear_f64", {"linear_forward", "linear_backward"}, linear<double>});
  out.push_back({"grouped_gemm_f32_empty_groups", {"grouped_gemm"}, [](const Exec& ex) {
                   grouped_forward<float>(ex, kEmptyGroups, 7, 13);
                 }});
  out.push_back({"grouped_gemm_f32_uneven_groups", {"grouped_gemm"}, [](const Exec& ex) {
                   grouped_forward<float>(ex, kUnevenGroups, 17, 33);
                 }});
  out.push_back({"grouped_gemm_f64", {"grouped_gemm"}, [](const Exec& ex) {
                   grouped_forward<double>(ex, all_groups(), 5, 3);
                 }});
  out.push_back({"grouped_gemm_f32_fixed_rows", {"grouped_gemm"}, [](const Exec& ex) {
                   grouped_forward<float>(ex, kFixedGroups, 17, 33, /*fixed=*/true);
                 }});
  out.push_back({"grouped_gemm_wgrad_f32_fixed_rows", {"grouped_gemm_wgrad"}, [](const Exec& ex) {
                   grouped_wgrad<float>(ex, kFixedGroups, 17, 33, /*fixed=*/true);
                 }});
  out.push_back({"grouped_gemm_wgrad_f32_empty_groups", {"grouped_gemm_wgrad"}, [](const Exec& ex) {
                   grouped_wgrad<float>(ex, kEmptyGroups, 7, 13);
                 }});
  out.push_back({"grouped_gemm_wgrad_f32_uneven_groups",
                 {"grouped_gemm_wgrad"},
                 [](const Exec& ex) { grouped_wgrad<float>(ex, kUnevenGroups, 17, 33); }});
  out.push_back({"grouped_gemm_wgrad_f64", {"grouped_gemm_wgrad"}, [](const Exec& ex) {
                   grouped_wgrad<double>(ex, all_groups(), 5, 3);
                 }});
}

}  // namespace moecore::backend_test
