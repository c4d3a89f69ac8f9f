// The cuBLASLt / cuBLAS descriptors of the GEMMs (ops/desc/gemm_desc.h, grouped_gemm_desc.h)
// through plain-loop interpreters of the libraries' documented column-major semantics
// (common/blas_interpreter.h), against the row-major references ops::gemm_ref, gemm_bf16_ref,
// grouped_gemm_ref and grouped_gemm_wgrad_ref: bitwise, over whole buffers (padding between
// rows and after the last batch item must stay as it was). Awkward shapes: every transpose,
// leading dimensions wider than the rows, batch strides with gaps, 1-row and 1-column problems,
// K = 1, experts with zero rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/blas_interpreter.h"
#include "common/testing.h"
#include "core/check.h"
#include "core/dtype.h"
#include "ops/desc/gemm_desc.h"
#include "ops/desc/grouped_gemm_desc.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/grouped_gemm_tables.h"

namespace moecore::ops::desc {
namespace {

using moecore::testing::gemm_grouped_batched;
using moecore::testing::lt_matmul;

// Small integers: every product and sum is exact, so the interpreter and the references agree
// bitwise whatever the compiler contracts into FMAs; a wrong index still changes the result.
template <typename T>
std::vector<T> random_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-16, 16);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<T>(u(rng));
  return v;
}

std::vector<bf16> random_bf16(int64_t n, uint32_t seed) {
  std::vector<float> f = random_values<float>(n, seed);
  std::vector<bf16> v(f.size());
  for (size_t i = 0; i < f.size(); ++i) v[i] = float_to_bf16(f[i]);
  return v;
}

template <typename T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << "element " << i << ": got " << got[i] << " want " << want[i];
}

const void* slot(GemmOperand which, const void* A, const void* B) {
  return which == GemmOperand::A ? A : B;
}

// A padded, strided, batched row-major call through the descriptor vs gemm_ref per batch item.
template <typename T>
void check_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t pad, int64_t batch,
                double alpha, double beta, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb << " M=" << M << " N=" << N
                                    << " K=" << K << " pad=" << pad << " batch=" << batch
                                    << " alpha=" << alpha << " beta=" << beta);
  GemmCall call;
  call.types = std::is_same_v<T, double> ? GemmTypes::F64 : GemmTypes::F32;
  call.trans_a = ta;
  call.trans_b = tb;
  call.M = M;
  call.N = N;
  call.K = K;
  call.lda = (ta ? M : K) + pad;
  call.ldb = (tb ? K : N) + pad;
  call.ldc = N + pad;
  const int64_t a_rows = ta ? K : M, b_rows = tb ? N : K;
  call.stride_a = a_rows * call.lda + 3;  // gaps between batch items
  call.stride_b = b_rows * call.ldb + 5;
  call.stride_c = M * call.ldc + 2;
  call.batch = batch;
  call.alpha = alpha;
  call.beta = beta;
  const auto A = random_values<T>(call.stride_a * batch, seed);
  const auto B = random_values<T>(call.stride_b * batch, seed + 1);
  auto want = random_values<T>(call.stride_c * batch, seed + 2);
  auto got = want;
  for (int64_t b = 0; b < batch; ++b)
    gemm_ref<T>(ta, tb, M, N, K, T(alpha), A.data() + b * call.stride_a, call.lda,
                B.data() + b * call.stride_b, call.ldb, T(beta), want.data() + b * call.stride_c,
                call.ldc);
  const LtMatmulDesc d = gemm_desc(call);
  lt_matmul(d, slot(d.a_operand, A.data(), B.data()), slot(d.b_operand, A.data(), B.data()),
            got.data());
  expect_bitwise(got, want);
}

TEST(DescGemm, LtMatmulEqualsGemmRefF32) {
  uint32_t seed = 1;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_gemm<float>(ta, tb, 7, 5, 3, 0, 1, 1.0, 0.0, seed++);
      check_gemm<float>(ta, tb, 7, 5, 3, 4, 1, 1.0, 1.0, seed++);   // ld > width, accumulate
      check_gemm<float>(ta, tb, 1, 13, 6, 2, 3, 0.5, 1.0, seed++);  // 1 row, batched
      check_gemm<float>(ta, tb, 9, 1, 1, 1, 2, 2.0, 0.0, seed++);   // 1 column, K = 1
      check_gemm<float>(ta, tb, 4, 6, 11, 3, 4, -1.0, 0.25, seed++);
    }
}

TEST(DescGemm, LtMatmulEqualsGemmRefF64) {
  uint32_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_gemm<double>(ta, tb, 5, 7, 4, 3, 2, 1.0, 1.0, seed++);
      check_gemm<double>(ta, tb, 1, 3, 2, 0, 1, 1.0, 0.0, seed++);
    }
}

TEST(DescGemm, Bf16InF32OutEqualsGemmBf16Ref) {
  uint32_t seed = 200;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (double beta : {0.0, 1.0}) {
        const int64_t M = 6, N = 5, K = 9, pad = 2;
        GemmCall call{GemmTypes::Bf16F32, ta, tb, M, N, K, (ta ? M : K) + pad,
                      (tb ? K : N) + pad, N + pad, 1.0, beta};
        const auto A = random_bf16((ta ? K : M) * call.lda, seed++);
        const auto B = random_bf16((tb ? N : K) * call.ldb, seed++);
        auto want = random_values<float>(M * call.ldc, seed++);
        auto got = want;
        gemm_bf16_ref(ta, tb, M, N, K, A.data(), call.lda, B.data(), call.ldb, float(beta),
                      want.data(), call.ldc);
        const LtMatmulDesc d = gemm_desc(call);
        lt_matmul(d, slot(d.a_operand, A.data(), B.data()), slot(d.b_operand, A.data(), B.data()),
                  got.data());
        SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb << " beta=" << beta);
        expect_bitwise(got, want);
      }
}

// The bf16-output form (fc1's h under --bf16 on CUDA): the bf16 D is the f32-output descriptor's
// result rounded to nearest even once, through the same interpreter (the layouts differ only in
// C's type); beta must be 0.
TEST(DescGemm, Bf16OutIsTheF32OutputRoundedOnce) {
  uint32_t seed = 260;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int64_t M = 6, N = 5, K = 9, pad = 2;
      GemmCall call{GemmTypes::Bf16Bf16, ta, tb, M, N, K, (ta ? M : K) + pad,
                    (tb ? K : N) + pad, N + pad, 1.0, 0.0};
      // Full-mantissa operands: the sums are rounded, so the roundings must agree.
      std::mt19937 rng(seed++);
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      std::vector<bf16> A((ta ? K : M) * call.lda), B((tb ? N : K) * call.ldb);
      for (bf16& v : A) v = float_to_bf16(u(rng));
      for (bf16& v : B) v = float_to_bf16(u(rng));
      std::vector<float> f32(M * call.ldc, 0.f);
      GemmCall f32_call = call;
      f32_call.types = GemmTypes::Bf16F32;
      const LtMatmulDesc d32 = gemm_desc(f32_call);
      lt_matmul(d32, slot(d32.a_operand, A.data(), B.data()),
                slot(d32.b_operand, A.data(), B.data()), f32.data());
      std::vector<bf16> want(f32.size()), got(f32.size(), bf16{0x7fc1});
      for (size_t i = 0; i < f32.size(); ++i) want[i] = float_to_bf16(f32[i]);
      const LtMatmulDesc d = gemm_desc(call);
      EXPECT_EQ(d.a.type, BlasDataType::R16BF);
      EXPECT_EQ(d.b.type, BlasDataType::R16BF);
      EXPECT_EQ(d.c.type, BlasDataType::R16BF);
      EXPECT_EQ(d.compute, BlasComputeType::F32);
      EXPECT_EQ(d.scale_type, BlasDataType::R32F);
      lt_matmul(d, slot(d.a_operand, A.data(), B.data()), slot(d.b_operand, A.data(), B.data()),
                got.data());
      SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < N; ++c) {
          const size_t i = static_cast<size_t>(r * call.ldc + c);
          ASSERT_EQ(got[i].bits, want[i].bits) << "row " << r << " col " << c;
        }
      // The padding between rows is not written.
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = N; c < call.ldc; ++c)
          EXPECT_EQ(got[static_cast<size_t>(r * call.ldc + c)].bits, 0x7fc1);
    }
  // Accumulating into a bf16 D would round twice: refused, naming the way that accumulates.
  const GemmCall add{GemmTypes::Bf16Bf16, false, false, 2, 3, 4, 4, 3, 3, 1.0, 1.0};
  EXPECT_NE(moecore::testing::error_of([&] { gemm_desc(add); }).find("Bf16F32"), std::string::npos);
  const int64_t m_G[] = {2, 0, 3};
  EXPECT_NE(moecore::testing::error_of([&] { grouped_batched_wgrad(GemmTypes::Bf16Bf16, m_G, 3, 4, 8); })
                .find("accumulates"),
            std::string::npos);
  const GroupedBatchedDesc fwd = grouped_batched_forward(GemmTypes::Bf16Bf16, m_G, 3, 4, 8, true);
  EXPECT_EQ(fwd.a_type, BlasDataType::R16BF);
  EXPECT_EQ(fwd.c_type, BlasDataType::R16BF);
  EXPECT_EQ(fwd.compute, BlasComputeType::F32);
}

TEST(DescGemm, TypesAndComputeModes) {
  const LtMatmulDesc f32 = gemm_desc(GemmCall{GemmTypes::F32, false, false, 2, 3, 4, 4, 3, 3});
  EXPECT_EQ(f32.compute, BlasComputeType::F32);  // CUBLAS_COMPUTE_32F: TF32 off
  EXPECT_EQ(static_cast<int>(f32.compute), 68);
  EXPECT_EQ(f32.scale_type, BlasDataType::R32F);
  EXPECT_EQ(f32.a.type, BlasDataType::R32F);
  const LtMatmulDesc f64 = gemm_desc(GemmCall{GemmTypes::F64, false, false, 2, 3, 4, 4, 3, 3});
  EXPECT_EQ(f64.compute, BlasComputeType::F64);
  EXPECT_EQ(f64.scale_type, BlasDataType::R64F);
  EXPECT_EQ(f64.c.type, BlasDataType::R64F);
  const LtMatmulDesc bf = gemm_desc(GemmCall{GemmTypes::Bf16F32, false, true, 2, 3, 4, 4, 4, 3});
  EXPECT_EQ(bf.compute, BlasComputeType::F32);
  EXPECT_EQ(bf.scale_type, BlasDataType::R32F);
  EXPECT_EQ(bf.a.type, BlasDataType::R16BF);
  EXPECT_EQ(bf.b.type, BlasDataType::R16BF);
  EXPECT_EQ(bf.c.type, BlasDataType::R32F);
  // The swap: m = N, n = M, our B in the A slot with op_A from trans_b.
  EXPECT_EQ(bf.m, 3);
  EXPECT_EQ(bf.n, 2);
  EXPECT_EQ(bf.a_operand, GemmOperand::B);
  EXPECT_EQ(bf.trans_a, BlasOp::T);
  EXPECT_EQ(bf.trans_b, BlasOp::N);
  // Empty problems make no call.
  EXPECT_TRUE(gemm_desc(GemmCall{GemmTypes::F32, false, false, 0, 3, 4, 4, 3, 3}).empty);
}

// --fp32-matmul-precision high: every f32 form names CUBLAS_COMPUTE_32F_FAST_TF32 (77) with f32
// operands, output and scales; plain F32 stays COMPUTE_32F (above).
TEST(DescGemm, Tf32ComputeTypeOnEveryF32Form) {
  const auto expect_tf32 = [](BlasComputeType compute, BlasDataType a, BlasDataType b,
                              BlasDataType c) {
    EXPECT_EQ(compute, BlasComputeType::F32FastTf32);
    EXPECT_EQ(a, BlasDataType::R32F);
    EXPECT_EQ(b, BlasDataType::R32F);
    EXPECT_EQ(c, BlasDataType::R32F);
  };
  const LtMatmulDesc d = gemm_desc(GemmCall{GemmTypes::F32Tf32, false, true, 2, 3, 4, 4, 4, 3});
  EXPECT_EQ(static_cast<int>(d.compute), 77);
  EXPECT_STREQ(blas_compute_type_name(d.compute), "CUBLAS_COMPUTE_32F_FAST_TF32");
  EXPECT_EQ(d.scale_type, BlasDataType::R32F);
  expect_tf32(d.compute, d.a.type, d.b.type, d.c.type);
  const LtMatmulDesc padded =
      gemm_desc(padded_grouped_forward_call(GemmTypes::F32Tf32, 3, 4, 5, 6, true));
  expect_tf32(padded.compute, padded.a.type, padded.b.type, padded.c.type);
  const LtMatmulDesc padded_w =
      gemm_desc(padded_grouped_wgrad_call(GemmTypes::F32Tf32, 3, 4, 5, 6));
  expect_tf32(padded_w.compute, padded_w.a.type, padded_w.b.type, padded_w.c.type);
  const std::vector<int64_t> m_G = {2, 0, 3};
  const GroupedBatchedDesc fwd =
      grouped_batched_forward(GemmTypes::F32Tf32, m_G.data(), 3, 5, 6, false);
  expect_tf32(fwd.compute, fwd.a_type, fwd.b_type, fwd.c_type);
  const GroupedBatchedDesc wgrad = grouped_batched_wgrad(GemmTypes::F32Tf32, m_G.data(), 3, 5, 6);
  expect_tf32(wgrad.compute, wgrad.a_type, wgrad.b_type, wgrad.c_type);
  EXPECT_EQ(grouped_batched_forward(GemmTypes::F32, m_G.data(), 3, 5, 6, false).compute,
            BlasComputeType::F32);
}

// The interpreter's TF32 rounding: cvt.rna.tf32.f32 (to nearest, ties away from zero, 10
// explicit mantissa bits) and the truncating reading it is bounded against.
TEST(Tf32Model, RoundsToNearestTiesAwayOrTruncates) {
  using moecore::testing::tf32_round;
  using moecore::testing::tf32_truncate;
  EXPECT_EQ(tf32_round(1.0f), 1.0f);
  EXPECT_EQ(tf32_round(1.0f + 0x1p-10f), 1.0f + 0x1p-10f);  // 10 explicit bits kept
  const float tie = 1.0f + 0x1p-11f;                          // halfway to 1 + 2^-10
  EXPECT_EQ(tf32_round(tie), 1.0f + 0x1p-10f);                // away from zero
  EXPECT_EQ(tf32_round(-tie), -(1.0f + 0x1p-10f));
  EXPECT_EQ(tf32_round(3.0f + 0x1p-10f), 3.0f + 0x1p-9f);     // a tie above an even TF32: away
  EXPECT_EQ(tf32_round(tie - 0x1p-23f), 1.0f);
  EXPECT_EQ(tf32_round(tie + 0x1p-23f), 1.0f + 0x1p-10f);
  EXPECT_EQ(tf32_round(2.0f - 0x1p-23f), 2.0f);               // carries into the exponent
  EXPECT_EQ(tf32_truncate(tie), 1.0f);
  EXPECT_EQ(tf32_truncate(-(2.0f - 0x1p-23f)), -(2.0f - 0x1p-10f));
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(tf32_round(std::numeric_limits<float>::max()), inf);
  EXPECT_EQ(tf32_round(-inf), -inf);
  EXPECT_TRUE(std::isnan(tf32_round(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(tf32_truncate(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(tf32_round(0x1p-136f), 0x1p-136f);  // TF32's smallest subnormal is kept
  EXPECT_EQ(tf32_round(0x1p-140f), 0.0f);       // below half of it: zero
}

// The TF32 descriptor through the interpreter, on f32 inputs with full mantissas: within
// tf32_gemm_bound_factor(K) sum_k |a||b| of the exact product for both roundings (the bound of
// docs/numerics.md, "TF32 GEMM vs its exact product"), and visibly coarser than COMPUTE_32F,
// which stays within its own f32 bound: TF32 changes the arithmetic, and only when asked.
TEST(Tf32Model, GemmWithinTheBoundForEitherRounding) {
  using moecore::testing::Tf32Rounding;
  using moecore::testing::tf32_gemm_bound_factor;
  using moecore::testing::tf32_rounding;
  const int64_t M = 9, N = 7, K = 300;
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb);
      std::vector<float> A(M * K), B(K * N);
      for (auto& x : A) x = u(rng);
      for (auto& x : B) x = u(rng);
      const auto a_at = [&](int64_t i, int64_t p) { return A[ta ? p * M + i : i * K + p]; };
      const auto b_at = [&](int64_t p, int64_t j) { return B[tb ? j * K + p : p * N + j]; };
      std::vector<double> exact(M * N), mag(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j)
          for (int64_t p = 0; p < K; ++p) {
            exact[i * N + j] += double(a_at(i, p)) * double(b_at(p, j));
            mag[i * N + j] += std::abs(double(a_at(i, p)) * double(b_at(p, j)));
          }
      const auto run = [&](GemmTypes types) {
        std::vector<float> C(M * N, std::numeric_limits<float>::quiet_NaN());
        const LtMatmulDesc d =
            gemm_desc(GemmCall{types, ta, tb, M, N, K, ta ? M : K, tb ? K : N, N});
        lt_matmul(d, slot(d.a_operand, A.data(), B.data()), slot(d.b_operand, A.data(), B.data()),
                  C.data());
        double worst = 0;  // the largest |C - exact| / sum |a||b|
        for (int64_t e = 0; e < M * N; ++e)
          worst = std::max(worst, std::abs(double(C[e]) - exact[e]) / mag[e]);
        return worst;
      };
      const double bound = tf32_gemm_bound_factor(double(K));
      for (Tf32Rounding r : {Tf32Rounding::NearestTiesAway, Tf32Rounding::Truncate}) {
        tf32_rounding() = r;
        const double worst = run(GemmTypes::F32Tf32);
        tf32_rounding() = Tf32Rounding::NearestTiesAway;
        std::printf("[tf32] ta=%d tb=%d %s: worst |C - exact| / sum|a||b| = %.3g (bound %.3g)\n",
                    int(ta), int(tb), r == Tf32Rounding::Truncate ? "truncate" : "nearest-away",
                    worst, bound);
        EXPECT_LE(worst, bound);
        EXPECT_GT(worst, 0x1p-17) << "the TF32 rounding left no trace (64 x the f32 bound 2u)";
      }
      const double f32 = run(GemmTypes::F32);  // the interpreter sums f32 products in f64
      EXPECT_LE(f32, 2 * moecore::testing::kF32UnitRoundoff);
    }
}

TEST(DescGemm, RejectsShortLeadingDimensions) {
  EXPECT_THROW(gemm_desc(GemmCall{GemmTypes::F32, false, false, 2, 3, 4, 3, 3, 3}), Error);
  EXPECT_THROW(gemm_desc(GemmCall{GemmTypes::F32, true, false, 5, 3, 4, 4, 3, 3}), Error);
  EXPECT_THROW(gemm_desc(GemmCall{GemmTypes::F32, false, true, 2, 3, 4, 4, 3, 3}), Error);
  EXPECT_THROW(gemm_desc(GemmCall{GemmTypes::F32, false, false, 2, 3, 4, 4, 3, 2}), Error);
}

// ---- grouped GEMMs ----

// Padded dispatch: one strided-batched matmul == grouped_gemm_ref with every expert at cap rows.
TEST(DescGroupedGemm, PaddedStridedBatchedEqualsGroupedRef) {
  uint32_t seed = 300;
  for (bool trans_w : {false, true})
    for (int64_t cap : {1, 4}) {
      const int64_t G = 3, N = 5, K = 7;
      SCOPED_TRACE(::testing::Message() << "trans_w=" << trans_w << " cap=" << cap);
      const std::vector<int64_t> m_G(G, cap);
      const auto x = random_values<float>(G * cap * K, seed++);
      const auto w = random_values<float>(G * N * K, seed++);
      // forward
      auto want = random_values<float>(G * cap * N, seed++);
      auto got = want;
      grouped_gemm_ref<float>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, want.data());
      LtMatmulDesc d = gemm_desc(padded_grouped_forward_call(GemmTypes::F32, G, cap, N, K, trans_w));
      lt_matmul(d, slot(d.a_operand, x.data(), w.data()), slot(d.b_operand, x.data(), w.data()),
                got.data());
      expect_bitwise(got, want);
      // dgrad: dx = dy * op'(w), the forward with N and K exchanged and trans_w flipped
      const auto dy = random_values<float>(G * cap * N, seed++);
      auto want_dx = random_values<float>(G * cap * K, seed++);
      auto got_dx = want_dx;
      grouped_gemm_ref<float>(m_G.data(), G, K, N, dy.data(), w.data(), !trans_w, want_dx.data());
      d = gemm_desc(padded_grouped_forward_call(GemmTypes::F32, G, cap, K, N, !trans_w));
      lt_matmul(d, slot(d.a_operand, dy.data(), w.data()), slot(d.b_operand, dy.data(), w.data()),
                got_dx.data());
      expect_bitwise(got_dx, want_dx);
      // wgrad (accumulates)
      auto want_dw = random_values<float>(G * N * K, seed++);
      auto got_dw = want_dw;
      grouped_gemm_wgrad_ref<float>(m_G.data(), G, N, K, dy.data(), x.data(), want_dw.data());
      d = gemm_desc(padded_grouped_wgrad_call(GemmTypes::F32, G, cap, N, K));
      lt_matmul(d, slot(d.a_operand, dy.data(), x.data()), slot(d.b_operand, dy.data(), x.data()),
                got_dw.data());
      expect_bitwise(got_dw, want_dw);
    }
}

// Dropless: cublasGemmGroupedBatchedEx's tables == the grouped refs, zero-row experts included.
TEST(DescGroupedGemm, GroupedBatchedTablesEqualGroupedRef) {
  uint32_t seed = 400;
  const std::vector<std::vector<int64_t>> loads = {
      {3, 0, 5, 1}, {0, 0, 2, 0}, {1}, {0, 4}, {0, 0, 0}, {6, 1, 0, 0, 2}};
  for (bool trans_w : {false, true})
    for (const auto& m_G : loads) {
      const int64_t G = static_cast<int64_t>(m_G.size()), N = 6, K = 4;
      int64_t rows = 0, non_empty = 0;
      for (int64_t m : m_G) {
        rows += m;
        non_empty += m > 0;
      }
      SCOPED_TRACE(::testing::Message() << "trans_w=" << trans_w << " G=" << G << " rows=" << rows);
      const auto x = random_values<float>(rows * K, seed++);
      const auto w = random_values<float>(G * N * K, seed++);
      auto want = random_values<float>(rows * N, seed++);
      auto got = want;
      grouped_gemm_ref<float>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, want.data());
      GroupedBatchedDesc d = grouped_batched_forward(GemmTypes::F32, m_G.data(), G, N, K, trans_w);
      EXPECT_EQ(d.group_count, non_empty);
      gemm_grouped_batched(d, slot(d.a_operand, x.data(), w.data()),
                           slot(d.b_operand, x.data(), w.data()), got.data());
      expect_bitwise(got, want);
      // dgrad
      const auto dy = random_values<float>(rows * N, seed++);
      auto want_dx = random_values<float>(rows * K, seed++);
      auto got_dx = want_dx;
      grouped_gemm_ref<float>(m_G.data(), G, K, N, dy.data(), w.data(), !trans_w, want_dx.data());
      d = grouped_batched_forward(GemmTypes::F32, m_G.data(), G, K, N, !trans_w);
      gemm_grouped_batched(d, slot(d.a_operand, dy.data(), w.data()),
                           slot(d.b_operand, dy.data(), w.data()), got_dx.data());
      expect_bitwise(got_dx, want_dx);
      // wgrad
      auto want_dw = random_values<float>(G * N * K, seed++);
      auto got_dw = want_dw;
      grouped_gemm_wgrad_ref<float>(m_G.data(), G, N, K, dy.data(), x.data(), want_dw.data());
      d = grouped_batched_wgrad(GemmTypes::F32, m_G.data(), G, N, K);
      gemm_grouped_batched(d, slot(d.a_operand, dy.data(), x.data()),
                           slot(d.b_operand, dy.data(), x.data()), got_dw.data());
      expect_bitwise(got_dw, want_dw);
    }
}

// The device-table grouped GEMM's tables (ops/grouped_gemm_tables.h, the `_ref` the table kernel
// is tested against) describe the host-table path's problems: for the same m_G, problem by
// problem, the column-major form of table entry g (desc::column_major_gemm of its row-major
// fields) is the descriptor's group for expert g, with the same operand offsets; an empty expert
// has an entry that computes nothing (forward m = 0, wgrad k = 0, so dw_g stays). Then both
// interpreted (the table through the same column-major interpreter, as the emulated backend
// runs it): bitwise the same outputs, the rows and the dw of empty experts untouched.
struct TableForm {
  const char* name;
  GroupedGemmForm form;
  bool trans_w;
  bool dgrad;  // the forward with N and K exchanged and trans_w flipped
};

void expect_table_is_descriptor(GemmTypes types, const std::vector<int64_t>& m_G, TableForm tf,
                                uint32_t seed) {
  const int64_t G = static_cast<int64_t>(m_G.size());
  const int64_t N = tf.dgrad ? 4 : 6, K = tf.dgrad ? 6 : 4;  // the call's N, K
  int64_t rows = 0;
  for (int64_t m : m_G) rows += m;
  SCOPED_TRACE(::testing::Message() << tf.name << " G=" << G << " rows=" << rows
                                    << " types=" << int(types));
  const bool wgrad = tf.form == GroupedGemmForm::Wgrad;
  const GroupedBatchedDesc d = wgrad ? grouped_batched_wgrad(types, m_G.data(), G, N, K)
                                     : grouped_batched_forward(types, m_G.data(), G, N, K,
                                                               tf.trans_w);
  // Operands in their element types: A / B in the input type, D in the output type.
  const size_t in = static_cast<size_t>(gemm_input_bytes(types));
  const size_t out = static_cast<size_t>(gemm_output_bytes(types));
  const int64_t a_elems = wgrad ? rows * N : rows * K, b_elems = wgrad ? rows * K : G * N * K;
  const int64_t d_elems = wgrad ? G * N * K : rows * N;
  std::vector<unsigned char> a(std::max<int64_t>(a_elems, 1) * in), b(std::max<int64_t>(b_elems, 1) * in);
  std::vector<unsigned char> d0(std::max<int64_t>(d_elems, 1) * out);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-16, 16);
  const auto fill = [&](std::vector<unsigned char>& v, size_t elem) {
    for (size_t i = 0; i < v.size() / elem; ++i) {
      const float x = float(u(rng));
      if (elem == 8) {
        const double y = x;
        std::memcpy(v.data() + i * 8, &y, 8);
      } else if (elem == 4) {
        std::memcpy(v.data() + i * 4, &x, 4);
      } else {
        const bf16 y = float_to_bf16(x);
        std::memcpy(v.data() + i * 2, &y, 2);
      }
    }
  };
  fill(a, in);
  fill(b, in);
  fill(d0, out);
  std::vector<cuda::GroupedGemmProblem> table(static_cast<size_t>(G));
  grouped_gemm_tables_ref(table.data(), m_G.data(), G, tf.form, types, N, K, tf.trans_w, a.data(),
                          b.data(), d0.data());
  // Problem by problem.
  int32_t i = 0;  // the descriptor's group
  for (int64_t g = 0; g < G; ++g) {
    const cuda::GroupedGemmProblem& p = table[static_cast<size_t>(g)];
    SCOPED_TRACE(::testing::Message() << "expert " << g << " (" << m_G[g] << " rows)");
    EXPECT_EQ(p.reserved, 0);
    if (m_G[g] == 0) {
      EXPECT_EQ(wgrad ? p.k : p.m, 0) << "an empty expert's problem must compute nothing";
      EXPECT_TRUE(i >= d.group_count || d.expert[i] != g);
      continue;
    }
    ASSERT_LT(i, d.group_count);
    ASSERT_EQ(d.expert[i], g);
    const ColumnMajorGemm c = column_major_gemm("table", p.trans_a, p.trans_b, p.m, p.n, p.k,
                                                p.lda, p.ldb, p.ldd);
    EXPECT_EQ(c.op_a, d.transa[i]);
    EXPECT_EQ(c.op_b, d.transb[i]);
    EXPECT_EQ(c.m, d.m[i]);
    EXPECT_EQ(c.n, d.n[i]);
    EXPECT_EQ(c.k, d.k[i]);
    EXPECT_EQ(c.lda, d.lda[i]);
    EXPECT_EQ(c.ldb, d.ldb[i]);
    EXPECT_EQ(c.ldc, d.ldc[i]);
    EXPECT_EQ(c.a_operand, d.a_operand);
    EXPECT_EQ(c.b_operand, d.b_operand);
    EXPECT_EQ(d.beta[i], wgrad ? 1.0 : 0.0);
    // Our A, B, D offsets (in elements) against the descriptor's slot offsets.
    const auto off = [](const void* p, const void* base, size_t elem) {
      return (static_cast<const unsigned char*>(p) - static_cast<const unsigned char*>(base)) /
             static_cast<int64_t>(elem);
    };
    const int64_t our_a = off(p.a, a.data(), in), our_b = off(p.b, b.data(), in);
    EXPECT_EQ(d.a_operand == GemmOperand::B ? our_b : our_a, d.a_off[i]);
    EXPECT_EQ(d.b_operand == GemmOperand::A ? our_a : our_b, d.b_off[i]);
    EXPECT_EQ(off(p.d, d0.data(), out), d.c_off[i]);
    ++i;
  }
  EXPECT_EQ(i, d.group_count);
  // Both interpreted: the descriptor as cuBLAS runs it, the table as the device backend runs it.
  std::vector<unsigned char> want = d0, got = d0;
  gemm_grouped_batched(d, slot(d.a_operand, a.data(), b.data()),
                       slot(d.b_operand, a.data(), b.data()), want.data());
  const BlasDataType it = gemm_input_type(types), ot = gemm_output_type(types);
  std::vector<cuda::GroupedGemmProblem> rebased(table);
  for (cuda::GroupedGemmProblem& p : rebased) {  // onto `got`
    p.d = got.data() + (static_cast<unsigned char*>(p.d) - d0.data());
    if (p.m == 0 || p.n == 0) continue;
    moecore::testing::blas_gemm_colmajor(p.trans_b ? BlasOp::T : BlasOp::N,
                                         p.trans_a ? BlasOp::T : BlasOp::N, p.n, p.m, p.k, 1.0,
                                         it, p.b, p.ldb, it, p.a, p.lda, wgrad ? 1.0 : 0.0, ot,
                                         p.d, p.ldd);
  }
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0)
      << "the table's problems and the descriptor's computed other bytes";
}

TEST(DescGroupedGemm, DeviceTablesDescribeTheGroupedBatchedProblems) {
  const std::vector<std::vector<int64_t>> loads = {
      {3, 0, 5, 1}, {0, 0, 2, 0}, {1}, {0, 4}, {0, 0, 0}, {6, 1, 0, 0, 2}, {0}, {2, 2, 0, 0}};
  const TableForm forms[] = {{"forward", GroupedGemmForm::Forward, false, false},
                             {"forward trans_w", GroupedGemmForm::Forward, true, false},
                             {"dgrad (of trans_w)", GroupedGemmForm::Forward, false, true},
                             {"dgrad (of w [G, K, N])", GroupedGemmForm::Forward, true, true},
                             {"wgrad", GroupedGemmForm::Wgrad, false, false}};
  uint32_t seed = 700;
  for (GemmTypes types :
       {GemmTypes::F32, GemmTypes::F64, GemmTypes::Bf16F32, GemmTypes::Bf16Bf16})
    for (const TableForm& tf : forms) {
      // A bf16 output is assigned only: no weight gradient (it accumulates).
      if (types == GemmTypes::Bf16Bf16 && tf.form == GroupedGemmForm::Wgrad) continue;
      for (const auto& m_G : loads) expect_table_is_descriptor(types, m_G, tf, seed++);
    }
}

// A negative count is read as 0 by the tables (the host tables refuse it: RejectsNegativeCounts).
TEST(DescGroupedGemm, DeviceTablesReadNegativeCountsAsZero) {
  const std::vector<int64_t> m_G = {2, -1, 3};
  std::vector<cuda::GroupedGemmProblem> t(3);
  std::vector<float> x(5 * 4), w(3 * 6 * 4), y(5 * 6);
  grouped_gemm_tables_ref(t.data(), m_G.data(), 3, GroupedGemmForm::Forward, GemmTypes::F32, 6, 4,
                          true, x.data(), w.data(), y.data());
  EXPECT_EQ(t[1].m, 0);
  EXPECT_EQ(t[2].m, 3);
  EXPECT_EQ(t[2].a, static_cast<const void*>(x.data() + 2 * 4));
  EXPECT_EQ(t[2].d, static_cast<void*>(y.data() + 2 * 6));
}

TEST(DescGroupedGemm, RejectsNegativeCounts) {
  const std::vector<int64_t> m_G = {2, -1};
  EXPECT_THROW(grouped_batched_forward(GemmTypes::F32, m_G.data(), 2, 3, 4, false), Error);
}

}  // namespace
}  // namespace moecore::ops::desc
