// A GEMM whose answer is known without running a GEMM: operands filled by affine formulas of
// their indices, so C = alpha op(A) op(B) + beta C0 has a closed form (sums of k and k^2), with
// small integers whose products and sums are exact in f32 and f64 in any summation order. It is
// the oracle for the f64 GEMM, which has no fast path (ops::gemm<double> runs gemm_ref), and it
// checks gemm_ref itself, which the fast f32 paths are compared with.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace moecore::testing {

// op(A)[i,k] = 1 + 2i - k, op(B)[k,j] = 2 + k - 3j, C0[i,j] = 1 + i - 2j: no formula is
// symmetric in its two indices, so a transposed or strided read of any operand changes the
// answer. A and B are stored as the GEMM reads them (transposed when ta / tb), with `pad` extra
// columns per row holding NaN (a read of the padding poisons C); C's padding holds a sentinel
// that `want` keeps (a write there is caught). With beta == 0, C0 is NaN: BLAS does not read C.
template <typename T>
struct GemmOracle {
  bool ta = false, tb = false;
  int64_t M = 0, N = 0, K = 0, lda = 1, ldb = 1, ldc = 1;
  T alpha = 1, beta = 0;
  std::vector<T> a, b, c0, want;  // want: C after the GEMM, M x ldc like c0
};

inline constexpr double kGemmOraclePadC = 7777;  // C's padding columns

template <typename T>
GemmOracle<T> gemm_oracle(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, T beta,
                          int64_t pad) {
  GemmOracle<T> g;
  g.ta = ta, g.tb = tb, g.M = M, g.N = N, g.K = K, g.alpha = alpha, g.beta = beta;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
  const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
  g.lda = std::max<int64_t>(1, a_cols + pad);
  g.ldb = std::max<int64_t>(1, b_cols + pad);
  g.ldc = std::max<int64_t>(1, N + pad);
  g.a.assign(a_rows * g.lda, nan);
  g.b.assign(b_rows * g.ldb, nan);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      (ta ? g.a[k * g.lda + i] : g.a[i * g.lda + k]) = static_cast<T>(1 + 2 * i - k);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t j = 0; j < N; ++j) {
      (tb ? g.b[j * g.ldb + k] : g.b[k * g.ldb + j]) = static_cast<T>(2 + k - 3 * j);
    }
  }
  g.c0.assign(M * g.ldc, static_cast<T>(kGemmOraclePadC));
  g.want = g.c0;
  // sum_k (p - k)(q + k) = K p q + S1 (p - q) - S2 with p = 1 + 2i, q = 2 - 3j.
  const double S1 = K * (K - 1) / 2.0, S2 = (K - 1) * K * (2.0 * K - 1) / 6.0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      const double p = 1.0 + 2 * i, q = 2.0 - 3 * j, c = 1.0 + i - 2 * j;
      const double prod = K * p * q + S1 * (p - q) - S2;
      g.c0[i * g.ldc + j] = beta == T(0) ? nan : static_cast<T>(c);
      g.want[i * g.ldc + j] = static_cast<T>(static_cast<double>(alpha) * prod +
                                             (beta == T(0) ? 0.0 : static_cast<double>(beta) * c));
    }
  }
  return g;
}

// The shapes and scalars every caller runs: all transposes; 1, 7, 13 in each dimension; padded
// leading dimensions with alpha / beta (halves and quarters: still exact); beta == 0 over NaN;
// and one larger product (K = 130, |C| < 2^23, exact in f32).
template <typename T, typename F>
void for_each_gemm_oracle(F&& check) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (int64_t M : {1, 7, 13}) {
        for (int64_t N : {1, 7, 13}) {
          for (int64_t K : {1, 7, 13}) check(gemm_oracle<T>(ta, tb, M, N, K, T(1), T(0), 0));
        }
      }
      check(gemm_oracle<T>(ta, tb, 13, 7, 29, T(0.5), T(-1.5), 3));
      check(gemm_oracle<T>(ta, tb, 7, 13, 1, T(-2), T(1), 5));
      check(gemm_oracle<T>(ta, tb, 1, 1, 13, T(1), T(0.25), 1));
      check(gemm_oracle<T>(ta, tb, 9, 11, 17, T(1), T(0), 2));
      check(gemm_oracle<T>(ta, tb, 33, 65, 130, T(1), T(0), 0));
    }
  }
}

}  // namespace moecore::testing
