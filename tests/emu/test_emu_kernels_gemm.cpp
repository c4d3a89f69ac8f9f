// The GEMM dispatch of the CUDA backend (src/ops/cuda/gemm.cu) through the emulated library calls
// (tests/emu/blas_emu.cpp), against the ops' `_ref` within the dtype's tolerance: the linear
// forms (assign and accumulate, dx null), the grouped forward in both weight layouts and its
// wgrad with empty groups first, in the middle and last, and the bf16 forms against the
// references on the same bf16 values; guarded outputs (NaN-filled where the op assigns).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/blas_interpreter.h"
#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/cast.h"
#include "ops/f32_matmul_precision.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore {
namespace {

using emu_test::kAtol;
using emu_test::kRtol;
using testing::Guarded;
using testing::random_vec;

const Exec kCuda{Device::CUDA, nullptr};

template <typename T>
Guarded<T> filled(int64_t n, const std::vector<T>* from = nullptr) {
  Guarded<T> g(n, std::numeric_limits<T>::quiet_NaN());
  if (from) std::copy(from->begin(), from->end(), g.data());
  return g;
}

template <typename T, typename W>
void expect_near_all(const Guarded<T>& got, const std::vector<W>& want, const char* what,
                     double rtol = kRtol<T>, double atol = kAtol<T>) {
  ASSERT_TRUE(got.intact()) << what << " written outside its elements";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(double(got[int64_t(i)]), double(want[i]), atol + rtol * std::abs(double(want[i])))
        << what << " element " << i;
  }
}

template <typename T>
void check_linear(int64_t M, int64_t N, int64_t K, bool accumulate) {
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
               " accumulate=" + std::to_string(accumulate));
  const auto x = random_vec<T>(M * K, 1), w = random_vec<T>(N * K, 2), dy = random_vec<T>(M * N, 3);
  const auto y0 = random_vec<T>(M * N, 4), dx0 = random_vec<T>(M * K, 5),
             dw0 = random_vec<T>(N * K, 6);
  const int64_t lk = std::max<int64_t>(1, K), ln = std::max<int64_t>(1, N);
  std::vector<T> y_ref = y0, dx_ref = dx0, dw_ref = dw0;
  ops::gemm_ref<T>(false, true, M, N, K, T(1), x.data(), lk, w.data(), lk, accumulate ? T(1) : T(0),
                   y_ref.data(), ln);
  ops::gemm_ref<T>(false, false, M, K, N, T(1), dy.data(), ln, w.data(), lk,
                   accumulate ? T(1) : T(0), dx_ref.data(), lk);
  ops::gemm_ref<T>(true, false, N, K, M, T(1), dy.data(), ln, x.data(), lk, T(1), dw_ref.data(),
                   lk);
  Guarded<T> y = accumulate ? filled<T>(M * N, &y0) : filled<T>(M * N),
             dx = accumulate ? filled<T>(M * K, &dx0) : filled<T>(M * K),
             dw = filled<T>(N * K, &dw0);
  ops::cuda::linear_forward<T>(kCuda, y.data(), x.data(), w.data(), M, N, K, accumulate);
  ops::cuda::linear_backward<T>(kCuda, dx.data(), dw.data(), dy.data(), x.data(), w.data(), M, N, K,
                                accumulate);
  expect_near_all(y, y_ref, "y");
  expect_near_all(dx, dx_ref, "dx");
  expect_near_all(dw, dw_ref, "dw");
  // dx null: dw alone.
  Guarded<T> dw2 = filled<T>(N * K, &dw0);
  ops::cuda::linear_backward<T>(kCuda, nullptr, dw2.data(), dy.data(), x.data(), w.data(), M, N, K,
                                false);
  expect_near_all(dw2, dw_ref, "dw (dx null)");
}

TEST(EmuKernelsGemm, LinearMatchesTheReference) {
  for (auto [M, N, K] : std::vector<std::array<int64_t, 3>>{
           {1, 1, 1}, {7, 13, 5}, {33, 3, 40}, {0, 4, 3}, {5, 0, 3}}) {
    for (bool acc : {false, true}) {
      check_linear<float>(M, N, K, acc);
      check_linear<double>(M, N, K, acc);
    }
  }
}

template <typename T>
void check_grouped(const std::vector<int64_t>& m_G, int64_t N, int64_t K, bool trans_w) {
  const int64_t G = int64_t(m_G.size());
  const int64_t rows = std::accumulate(m_G.begin(), m_G.end(), int64_t{0});
  SCOPED_TRACE("G=" + std::to_string(G) + " rows=" + std::to_string(rows) +
               " N=" + std::to_string(N) + " K=" + std::to_string(K) +
               " trans_w=" + std::to_string(trans_w));
  const auto x = random_vec<T>(rows * K, 11), w = random_vec<T>(G * N * K, 12),
             dy = random_vec<T>(rows * N, 13), dw0 = random_vec<T>(G * N * K, 14);
  std::vector<T> y_ref(size_t(rows * N)), dw_ref = dw0;
  ops::grouped_gemm_ref<T>(m_G.data(), G, N, K, x.data(), w.data(), trans_w, y_ref.data());
  ops::grouped_gemm_wgrad_ref<T>(m_G.data(), G, N, K, dy.data(), x.data(), dw_ref.data());
  Guarded<T> y = filled<T>(rows * N), dw = filled<T>(G * N * K, &dw0);
  ops::cuda::grouped_gemm<T>(kCuda, m_G.data(), G, N, K, x.data(), w.data(), trans_w, y.data());
  ops::cuda::grouped_gemm_wgrad<T>(kCuda, m_G.data(), G, N, K, dy.data(), x.data(), dw.data());
  expect_near_all(y, y_ref, "y");
  expect_near_all(dw, dw_ref, "dw (accumulated)");

  if constexpr (std::is_same_v<T, float>) {  // the bf16 forms on the same bf16 values
    std::vector<bf16> x16(x.size()), w16(w.size()), dy16(dy.size());
    ops::cast_f32_to_bf16_ref(x16.data(), x.data(), int64_t(x.size()));
    ops::cast_f32_to_bf16_ref(w16.data(), w.data(), int64_t(w.size()));
    ops::cast_f32_to_bf16_ref(dy16.data(), dy.data(), int64_t(dy.size()));
    std::vector<float> xr(x.size()), wr(w.size()), dyr(dy.size());
    ops::cast_bf16_to_f32_ref(xr.data(), x16.data(), int64_t(x.size()));
    ops::cast_bf16_to_f32_ref(wr.data(), w16.data(), int64_t(w.size()));
    ops::cast_bf16_to_f32_ref(dyr.data(), dy16.data(), int64_t(dy.size()));
    std::vector<float> y16_ref(size_t(rows * N)), dw16_ref = dw0;
    ops::grouped_gemm_ref<float>(m_G.data(), G, N, K, xr.data(), wr.data(), trans_w,
                                 y16_ref.data());
    ops::grouped_gemm_wgrad_ref<float>(m_G.data(), G, N, K, dyr.data(), xr.data(), dw16_ref.data());
    Guarded<float> y16 = filled<float>(rows * N), dw16 = filled<float>(G * N * K, &dw0);
    ops::cuda::grouped_gemm_bf16(kCuda, m_G.data(), G, N, K, x16.data(), w16.data(), trans_w,
                                 y16.data());
    ops::cuda::grouped_gemm_wgrad_bf16(kCuda, m_G.data(), G, N, K, dy16.data(), x16.data(),
                                       dw16.data());
    expect_near_all(y16, y16_ref, "y (bf16)");
    expect_near_all(dw16, dw16_ref, "dw (bf16, accumulated)");
  }
}

TEST(EmuKernelsGemm, GroupedMatchesTheReference) {
  for (bool trans_w : {false, true}) {
    for (const auto& m_G :
         std::vector<std::vector<int64_t>>{{3}, {0, 5, 0, 2}, {4, 0, 3, 0}, {0, 0}, {}}) {
      check_grouped<float>(m_G, 7, 5, trans_w);
      check_grouped<double>(m_G, 3, 9, trans_w);
    }
  }
}

TEST(EmuKernelsGemm, LinearBf16MatchesTheReferenceOnBf16Values) {
  const int64_t M = 9, N = 6, K = 13;
  const auto x = random_vec<float>(M * K, 21), w = random_vec<float>(N * K, 22),
             dy = random_vec<float>(M * N, 23), dw0 = random_vec<float>(N * K, 24);
  std::vector<bf16> w16(w.size());
  ops::cast_f32_to_bf16_ref(w16.data(), w.data(), N * K);
  const auto rounded = [](const std::vector<float>& v) {
    std::vector<bf16> b(v.size());
    std::vector<float> r(v.size());
    ops::cast_f32_to_bf16_ref(b.data(), v.data(), int64_t(v.size()));
    ops::cast_bf16_to_f32_ref(r.data(), b.data(), int64_t(v.size()));
    return r;
  };
  const auto xr = rounded(x), wr = rounded(w), dyr = rounded(dy);
  std::vector<float> y_ref(size_t(M * N)), dx_ref(size_t(M * K)), dw_ref = dw0;
  ops::gemm_ref<float>(false, true, M, N, K, 1.f, xr.data(), K, wr.data(), K, 0.f, y_ref.data(), N);
  ops::gemm_ref<float>(false, false, M, K, N, 1.f, dyr.data(), N, wr.data(), K, 0.f, dx_ref.data(),
                       K);
  ops::gemm_ref<float>(true, false, N, K, M, 1.f, dyr.data(), N, xr.data(), K, 1.f, dw_ref.data(),
                       K);
  Guarded<float> y = filled<float>(M * N), dx = filled<float>(M * K),
                 dw = filled<float>(N * K, &dw0);
  Guarded<uint16_t> x16(M * K), dy16(M * N);  // bf16 bits
  bf16* x16p = reinterpret_cast<bf16*>(x16.data());
  ops::cuda::linear_forward_bf16(kCuda, y.data(), x.data(), w16.data(), M, N, K, x16p);
  ops::cuda::linear_backward_bf16(kCuda, dx.data(), dw.data(), dy.data(), x.data(), w16.data(), M,
                                  N, K, reinterpret_cast<bf16*>(dy16.data()), x16p);
  expect_near_all(y, y_ref, "y");
  expect_near_all(dx, dx_ref, "dx");
  expect_near_all(dw, dw_ref, "dw (accumulated)");
  EXPECT_TRUE(x16.intact() && dy16.intact()) << "bf16 workspace written out of bounds";
  EXPECT_THROW(
      ops::cuda::gemm_bf16(kCuda, false, false, 1, 1, 1, x16p, 1, w16.data(), 1, 0.5f, y.data(), 1),
      Error);
}

// --fp32-matmul-precision high on CUDA: the f32 GEMMs of the dispatch (linear forward, dx, dw;
// grouped forward and wgrad) take TF32 products, so they equal the references on TF32-rounded
// inputs (within the f32 row: f32 sums against the reference's f64 ones) and miss the references
// on the inputs as given by far more than that row; f64 is untouched; highest is bitwise as before.
TEST(EmuKernelsGemm, Tf32PrecisionRoundsTheF32GemmInputs) {
  struct High {  // the process's setting for this test, restored after it
    High() { ops::set_f32_matmul_precision(ops::F32MatmulPrecision::High); }
    ~High() { ops::set_f32_matmul_precision(ops::F32MatmulPrecision::Highest); }
  } high;
  const Exec& tf32 = kCuda;
  ASSERT_TRUE(ops::f32_gemm_tf32(Device::CUDA));
  ASSERT_FALSE(ops::f32_gemm_tf32(Device::CPU));  // the CPU has no TF32
  const auto rounded = [](const std::vector<float>& v) {
    std::vector<float> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = testing::tf32_round(v[i]);
    return r;
  };
  // The largest |got - want| / (1 + |want|): near 0 against the rounded inputs, about 2^-11
  // relative to the products' size against the unrounded ones.
  const auto worst = [](const Guarded<float>& got, const std::vector<float>& want) {
    double w = 0;
    for (size_t i = 0; i < want.size(); ++i)
      w = std::max(w, std::abs(double(got[int64_t(i)]) - double(want[i])) /
                          (1.0 + std::abs(double(want[i]))));
    return w;
  };
  const int64_t M = 17, N = 11, K = 64;
  const auto x = random_vec<float>(M * K, 31), w = random_vec<float>(N * K, 32),
             dy = random_vec<float>(M * N, 33), dw0 = random_vec<float>(N * K, 34);
  const auto xr = rounded(x), wr = rounded(w), dyr = rounded(dy);
  std::vector<float> y_t(size_t(M * N)), dx_t(size_t(M * K)), dw_t = dw0;  // on rounded inputs
  ops::gemm_ref<float>(false, true, M, N, K, 1.f, xr.data(), K, wr.data(), K, 0.f, y_t.data(), N);
  ops::gemm_ref<float>(false, false, M, K, N, 1.f, dyr.data(), N, wr.data(), K, 0.f, dx_t.data(),
                       K);
  ops::gemm_ref<float>(true, false, N, K, M, 1.f, dyr.data(), N, xr.data(), K, 1.f, dw_t.data(), K);
  std::vector<float> y_f(size_t(M * N));  // on the inputs as given
  ops::gemm_ref<float>(false, true, M, N, K, 1.f, x.data(), K, w.data(), K, 0.f, y_f.data(), N);
  Guarded<float> y = filled<float>(M * N), dx = filled<float>(M * K),
                 dw = filled<float>(N * K, &dw0);
  ops::cuda::linear_forward<float>(tf32, y.data(), x.data(), w.data(), M, N, K, false);
  ops::cuda::linear_backward<float>(tf32, dx.data(), dw.data(), dy.data(), x.data(), w.data(), M, N,
                                    K, false);
  expect_near_all(y, y_t, "y (TF32)");
  expect_near_all(dx, dx_t, "dx (TF32)");
  expect_near_all(dw, dw_t, "dw (TF32, accumulated)");
  const double off = worst(y, y_f);
  std::printf("[tf32] linear forward M=%lld N=%lld K=%lld: worst |y - y_f32| / (1 + |y_f32|) = "
              "%.3g; against the rounded inputs %.3g\n",
              (long long)M, (long long)N, (long long)K, off, worst(y, y_t));
  EXPECT_GT(off, 10 * testing::kF32Rtol) << "TF32 asked for, full f32 products computed";

  // Grouped forward and wgrad (an empty expert in the middle).
  const std::vector<int64_t> m_G = {5, 0, 9};
  const int64_t G = 3, rows = 14;
  const auto gx = random_vec<float>(rows * K, 41), gw = random_vec<float>(G * N * K, 42),
             gdy = random_vec<float>(rows * N, 43), gdw0 = random_vec<float>(G * N * K, 44);
  const auto gxr = rounded(gx), gwr = rounded(gw), gdyr = rounded(gdy);
  std::vector<float> gy_t(size_t(rows * N)), gdw_t = gdw0;
  ops::grouped_gemm_ref<float>(m_G.data(), G, N, K, gxr.data(), gwr.data(), true, gy_t.data());
  ops::grouped_gemm_wgrad_ref<float>(m_G.data(), G, N, K, gdyr.data(), gxr.data(), gdw_t.data());
  Guarded<float> gy = filled<float>(rows * N), gdw = filled<float>(G * N * K, &gdw0);
  ops::cuda::grouped_gemm<float>(tf32, m_G.data(), G, N, K, gx.data(), gw.data(), true, gy.data());
  ops::cuda::grouped_gemm_wgrad<float>(tf32, m_G.data(), G, N, K, gdy.data(), gx.data(),
                                       gdw.data());
  expect_near_all(gy, gy_t, "grouped y (TF32)");
  expect_near_all(gdw, gdw_t, "grouped dw (TF32, accumulated)");

  // f64 keeps f64 products: bitwise the run at highest.
  const auto x64 = random_vec<double>(M * K, 51), w64 = random_vec<double>(N * K, 52);
  Guarded<double> y64 = filled<double>(M * N), y64_ref = filled<double>(M * N);
  ops::cuda::linear_forward<double>(tf32, y64.data(), x64.data(), w64.data(), M, N, K, false);
  ops::set_f32_matmul_precision(ops::F32MatmulPrecision::Highest);
  ops::cuda::linear_forward<double>(kCuda, y64_ref.data(), x64.data(), w64.data(), M, N, K, false);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(y64[i], y64_ref[i]) << "f64 element " << i;
  // Back at highest the f32 GEMM is the full-f32 one again: the reference on the given inputs.
  Guarded<float> y_hi = filled<float>(M * N);
  ops::cuda::linear_forward<float>(kCuda, y_hi.data(), x.data(), w.data(), M, N, K, false);
  expect_near_all(y_hi, y_f, "y (highest)");
}

}  // namespace
}  // namespace moecore
