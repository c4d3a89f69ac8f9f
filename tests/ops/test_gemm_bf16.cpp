// bf16 GEMM vs the plain loop on the same bf16 inputs: only the f32 summation order differs.
// Linear and grouped wrappers vs the f32 ops on the bf16-rounded values. Every test runs on both
// paths (native oneDNN bf16, which oneDNN emulates where the CPU lacks AVX512-BF16, and widen to
// f32 + sgemm), whatever the machine would choose.
#include <gtest/gtest.h>

#include <limits>

#include <omp.h>

#include "common/bf16_gemm_paths.h"
#include "common/testing.h"
#include "core/check.h"
#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops {
namespace {

using testing::all_close;
using testing::Guarded;
using testing::kF32Atol;
using testing::kF32Rtol;
using testing::random_vec;

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  cast_f32_to_bf16_ref(y.data(), x.data(), static_cast<int64_t>(x.size()));
  return y;
}

std::vector<float> rounded(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_float(float_to_bf16(x[i]));
  return y;
}

// Runs each test on one path and restores the process's choice afterwards. Workspaces are
// sized after the path is set, as the model plans them; NaN-filled so that a path reading
// workspace it did not write shows.
class GemmBf16 : public ::testing::TestWithParam<Bf16GemmPath> {
 protected:
  void SetUp() override {
    chosen_ = bf16_gemm_path();
    if (GetParam() == Bf16GemmPath::Native && !bf16_native_available()) {
      GTEST_SKIP() << "native bf16 path not run: oneDNN runs below AVX-512 here (no bf16 matmul)";
    }
    set_bf16_gemm_path(GetParam());
  }
  void TearDown() override { set_bf16_gemm_path(chosen_); }
  static std::vector<float> ws(int64_t n) {
    return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
  }

 private:
  Bf16GemmPath chosen_ = Bf16GemmPath::Native;
};

TEST_P(GemmBf16, FastMatchesReferenceAllTransposesAndShapes) {
  struct Shape {
    int64_t M, N, K;
  };
  for (Shape s : {Shape{1, 1, 1}, Shape{7, 13, 5}, Shape{64, 48, 96}, Shape{33, 17, 129}}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        for (float beta : {0.f, 1.f}) {
          const int64_t lda = (ta ? s.M : s.K) + 3, ldb = (tb ? s.K : s.N) + 2, ldc = s.N + 1;
          auto A = to_bf16(random_vec<float>((ta ? s.K : s.M) * lda, 1));
          auto B = to_bf16(random_vec<float>((tb ? s.N : s.K) * ldb, 2));
          auto C0 = random_vec<float>(s.M * ldc, 3);
          Guarded<float> fast(s.M * ldc), ref(s.M * ldc);
          for (int64_t i = 0; i < s.M * ldc; ++i) fast[i] = ref[i] = C0[i];
          auto ws32 = ws(gemm_bf16_workspace_elems(cpu_exec(), s.M, s.N, s.K));
          gemm_bf16(cpu_exec(), ta, tb, s.M, s.N, s.K, A.data(), lda, B.data(), ldb, beta,
                    fast.data(), ldc, ws32.data());
          gemm_bf16_ref(ta, tb, s.M, s.N, s.K, A.data(), lda, B.data(), ldb, beta, ref.data(), ldc);
          EXPECT_TRUE(fast.intact());
          EXPECT_TRUE(all_close(fast.data(), ref.data(), s.M * ldc, kF32Rtol, kF32Atol))
              << "M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << ta << " tb=" << tb
              << " beta=" << beta;
          // Padding columns of C are never written.
          for (int64_t i = 0; i < s.M; ++i) EXPECT_EQ(fast[i * ldc + s.N], C0[i * ldc + s.N]);
        }
      }
    }
  }
}

TEST_P(GemmBf16, LinearAndGroupedMatchF32OpsOnRoundedInputs) {
  const int64_t M = 19, N = 24, K = 40;
  auto x = random_vec<float>(M * K, 4), w = random_vec<float>(N * K, 5);
  auto dy = random_vec<float>(M * N, 6);
  auto w16 = to_bf16(w);
  std::vector<bf16> x16(M * K), dy16(M * N);
  std::vector<float> y(M * N), y_ref(M * N), dx(M * K), dx_ref(M * K), dw(N * K, 0.f),
      dw_ref(N * K, 0.f);
  auto lws = ws(linear_bf16_workspace_elems(cpu_exec(), M, N, K));
  linear_forward_bf16(cpu_exec(), y.data(), x.data(), w16.data(), M, N, K, x16.data(), lws.data());
  linear_backward_bf16(cpu_exec(), dx.data(), dw.data(), dy.data(), x.data(), w16.data(), M, N, K,
                       dy16.data(), x16.data(), lws.data());
  auto xr = rounded(x), wr = rounded(w), dyr = rounded(dy);
  gemm_ref<float>(false, true, M, N, K, 1.f, xr.data(), K, wr.data(), K, 0.f, y_ref.data(), N);
  gemm_ref<float>(false, false, M, K, N, 1.f, dyr.data(), N, wr.data(), K, 0.f, dx_ref.data(), K);
  gemm_ref<float>(true, false, N, K, M, 1.f, dyr.data(), N, xr.data(), K, 1.f, dw_ref.data(), K);
  EXPECT_TRUE(all_close(y, y_ref, kF32Rtol, kF32Atol));
  EXPECT_TRUE(all_close(dx, dx_ref, kF32Rtol, kF32Atol));
  EXPECT_TRUE(all_close(dw, dw_ref, kF32Rtol, kF32Atol));

  // Grouped: empty first and last groups.
  const std::vector<int64_t> m = {0, 7, 12, 0};
  const int64_t G = 4, rows = 19;
  auto wg = random_vec<float>(G * N * K, 7);
  auto wg16 = to_bf16(wg);
  std::vector<float> yg(rows * N), yg_ref(rows * N), dwg(G * N * K, 0.f), dwg_ref(G * N * K, 0.f);
  auto xg16 = to_bf16(x), dyg16 = to_bf16(dy);
  auto gws = ws(grouped_gemm_bf16_workspace_elems(cpu_exec(), rows, N, K, omp_get_max_threads()));
  auto wws = ws(grouped_gemm_wgrad_bf16_workspace_elems(cpu_exec(), rows, N, K));
  grouped_gemm_bf16(cpu_exec(), m.data(), G, N, K, xg16.data(), wg16.data(), true, yg.data(),
                    gws.data());
  grouped_gemm_wgrad_bf16(cpu_exec(), m.data(), G, N, K, dyg16.data(), xg16.data(), dwg.data(),
                          wws.data());
  auto wgr = rounded(wg);
  grouped_gemm_ref<float>(m.data(), G, N, K, xr.data(), wgr.data(), true, yg_ref.data());
  grouped_gemm_wgrad_ref<float>(m.data(), G, N, K, dyr.data(), xr.data(), dwg_ref.data());
  EXPECT_TRUE(all_close(yg, yg_ref, kF32Rtol, kF32Atol));
  EXPECT_TRUE(all_close(dwg, dwg_ref, kF32Rtol, kF32Atol));

  // The weights given already widened (Param::data16w): the same results, bitwise.
  std::vector<float> w32(N * K), wg32(G * N * K), y_w(M * N), dx_w(M * K), dw_w(N * K, 0.f),
      yg_w(rows * N);
  cast_bf16_to_f32_ref(w32.data(), w16.data(), N * K);
  cast_bf16_to_f32_ref(wg32.data(), wg16.data(), G * N * K);
  linear_forward_bf16(cpu_exec(), y_w.data(), x.data(), w16.data(), M, N, K, x16.data(), lws.data(),
                      w32.data());
  linear_backward_bf16(cpu_exec(), dx_w.data(), dw_w.data(), dy.data(), x.data(), w16.data(), M, N,
                       K, dy16.data(), x16.data(), lws.data(), w32.data());
  grouped_gemm_bf16(cpu_exec(), m.data(), G, N, K, xg16.data(), wg16.data(), true, yg_w.data(),
                    gws.data(), wg32.data());
  EXPECT_EQ(y_w, y);
  EXPECT_EQ(dx_w, dx);
  EXPECT_EQ(dw_w, dw);
  EXPECT_EQ(yg_w, yg);
  // x given already rounded to bf16 values (x_rounded), with and without widened weights: the
  // same results, bitwise (x itself is read, never written).
  for (const float* wide :
       {static_cast<const float*>(nullptr), static_cast<const float*>(w32.data())}) {
    const std::vector<float> xr_in = rounded(x);
    std::vector<float> y_r(M * N), dx_r(M * K), dw_r(N * K, 0.f);
    linear_forward_bf16(cpu_exec(), y_r.data(), xr_in.data(), w16.data(), M, N, K, x16.data(),
                        lws.data(), wide, /*x_rounded=*/true);
    linear_backward_bf16(cpu_exec(), dx_r.data(), dw_r.data(), dy.data(), xr_in.data(), w16.data(),
                         M, N, K, dy16.data(), x16.data(), lws.data(), wide, /*x_rounded=*/true);
    EXPECT_EQ(y_r, y);
    EXPECT_EQ(dx_r, dx);
    EXPECT_EQ(dw_r, dw);
    EXPECT_EQ(xr_in, rounded(x));
  }
  std::vector<float> c_w(M * N);
  auto cws = ws(gemm_bf16_workspace_elems(cpu_exec(), M, N, K));
  const auto xs16 = to_bf16(x);  // (the widen path's linear layers never write x16)
  gemm_bf16(cpu_exec(), false, true, M, N, K, xs16.data(), K, w16.data(), K, 0.f, c_w.data(), N,
            cws.data(), w32.data());
  EXPECT_TRUE(all_close(c_w, y_ref, kF32Rtol, kF32Atol));
}

// The remaining entry points and orientations the model uses: linear backward without dx (a
// first layer), grouped forward with untransposed weights [G, K, N], groups run in parallel
// (2 threads, even loads) and one after another (one dominant group), all-empty groups,
// K = 0 (y = 0), and wgrad accumulating into a non-zero dw.
TEST_P(GemmBf16, GroupedOrientationsEmptyGroupsAndAccumulation) {
  const int64_t N = 20, K = 36;
  const int threads0 = omp_get_max_threads();
  for (const std::vector<int64_t>& m :
       {std::vector<int64_t>{0, 9, 11, 0, 8}, std::vector<int64_t>{0, 30, 1, 0, 0},
        std::vector<int64_t>{0, 0, 0, 0, 0}}) {
    const int64_t G = static_cast<int64_t>(m.size());
    int64_t rows = 0;
    for (int64_t r : m) rows += r;
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      for (bool trans_w : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "rows=" << rows << " threads=" << threads << " trans_w=" << trans_w);
        auto x = random_vec<float>(rows * K, 11), dy = random_vec<float>(rows * N, 12);
        auto w = random_vec<float>(G * N * K, 13);
        auto x16 = to_bf16(x), dy16 = to_bf16(dy), w16 = to_bf16(w);
        auto xr = rounded(x), dyr = rounded(dy), wr = rounded(w);
        Guarded<float> y(rows * N);
        std::vector<float> y_ref(rows * N);
        auto gws = ws(grouped_gemm_bf16_workspace_elems(cpu_exec(), rows, N, K, threads));
        grouped_gemm_bf16(cpu_exec(), m.data(), G, N, K, x16.data(), w16.data(), trans_w, y.data(),
                          gws.data());
        grouped_gemm_ref<float>(m.data(), G, N, K, xr.data(), wr.data(), trans_w, y_ref.data());
        EXPECT_TRUE(y.intact());
        EXPECT_TRUE(all_close(y.data(), y_ref.data(), rows * N, kF32Rtol, kF32Atol));
        auto dw0 = random_vec<float>(G * N * K, 14);
        Guarded<float> dw(G * N * K);
        std::vector<float> dw_ref = dw0;
        for (int64_t i = 0; i < G * N * K; ++i) dw[i] = dw0[i];
        auto wws = ws(grouped_gemm_wgrad_bf16_workspace_elems(cpu_exec(), rows, N, K));
        grouped_gemm_wgrad_bf16(cpu_exec(), m.data(), G, N, K, dy16.data(), x16.data(), dw.data(),
                                wws.data());
        grouped_gemm_wgrad_ref<float>(m.data(), G, N, K, dyr.data(), xr.data(), dw_ref.data());
        EXPECT_TRUE(dw.intact());
        EXPECT_TRUE(all_close(dw.data(), dw_ref.data(), G * N * K, kF32Rtol, kF32Atol));
      }
    }
    // K = 0: empty products, y = 0.
    std::vector<float> y0(rows * N, 5.f);
    grouped_gemm_bf16(cpu_exec(), m.data(), G, N, 0, nullptr, nullptr, true, y0.data(), nullptr);
    for (float v : y0) EXPECT_EQ(v, 0.f);
  }
  omp_set_num_threads(threads0);

  // linear_backward_bf16 without dx: only dw, accumulated.
  const int64_t M = 23, Nl = 16, Kl = 40;
  auto x = random_vec<float>(M * Kl, 15), dy = random_vec<float>(M * Nl, 16);
  auto w16 = to_bf16(random_vec<float>(Nl * Kl, 17));
  std::vector<bf16> x16(M * Kl), dy16(M * Nl);
  auto dw = random_vec<float>(Nl * Kl, 18);
  auto dw_ref = dw;
  auto lws = ws(linear_bf16_workspace_elems(cpu_exec(), M, Nl, Kl));
  linear_backward_bf16(cpu_exec(), nullptr, dw.data(), dy.data(), x.data(), w16.data(), M, Nl, Kl,
                       dy16.data(), x16.data(), lws.data());
  auto xr = rounded(x), dyr = rounded(dy);
  gemm_ref<float>(true, false, Nl, Kl, M, 1.f, dyr.data(), Nl, xr.data(), Kl, 1.f, dw_ref.data(),
                  Kl);
  EXPECT_TRUE(all_close(dw, dw_ref, kF32Rtol, kF32Atol));
}

// The tests' path scope restores the process's choice at its end, also when an exception
// leaves it; each path runs once, the native one only where it exists.
TEST(GemmBf16Path, TestScopeRestoresTheChoice) {
  const Bf16GemmPath chosen = bf16_gemm_path();
  std::vector<Bf16GemmPath> seen;
  EXPECT_THROW(testing::for_each_bf16_gemm_path([&](Bf16GemmPath p) {
                 seen.push_back(bf16_gemm_path());
                 EXPECT_EQ(seen.back(), p);
                 if (p == Bf16GemmPath::Widen) throw moecore::Error("planted");
               }),
               moecore::Error);
  EXPECT_EQ(bf16_gemm_path(), chosen);
  std::vector<Bf16GemmPath> want = {Bf16GemmPath::Widen};
  if (bf16_native_available()) want.insert(want.begin(), Bf16GemmPath::Native);
  EXPECT_EQ(seen, want);
}

// The widen path cannot run without its workspace: a loud error, not a write through null.
TEST(GemmBf16Path, WidenWithoutWorkspaceFailsLoudly) {
  testing::ScopedBf16GemmPath scope(Bf16GemmPath::Widen);
  std::vector<bf16> a(4), b(4);
  std::vector<float> c(4);
  EXPECT_THROW(gemm_bf16(cpu_exec(), false, false, 2, 2, 2, a.data(), 2, b.data(), 2, 0.f, c.data(),
                         2, nullptr),
               moecore::Error);
  EXPECT_EQ(gemm_bf16_workspace_elems(cpu_exec(), 2, 3, 5), 2 * 5 + 5 * 3);
  if (bf16_native_available()) {
    set_bf16_gemm_path(Bf16GemmPath::Native);
    EXPECT_EQ(gemm_bf16_workspace_elems(cpu_exec(), 2, 3, 5), 0);
    EXPECT_NE(bf16_gemm_path_line().find("native"), std::string::npos);
  } else {
    EXPECT_THROW(set_bf16_gemm_path(Bf16GemmPath::Native), moecore::Error);
  }
}

// The native path cannot run without its bf16 copies of the f32 operands either.
TEST(GemmBf16Path, NativeWithoutBf16WorkspaceFailsLoudly) {
  if (!bf16_native_available()) GTEST_SKIP() << "this CPU has no native bf16 GEMM";
  testing::ScopedBf16GemmPath scope(Bf16GemmPath::Native);
  std::vector<bf16> w(6), x16(4), dy16(6);
  std::vector<float> x(4), y(6), dy(6), dx(4), dw(6);
  EXPECT_THROW(linear_forward_bf16(cpu_exec(), y.data(), x.data(), w.data(), 2, 3, 2, nullptr,
                                   nullptr),
               moecore::Error);
  EXPECT_THROW(linear_backward_bf16(cpu_exec(), dx.data(), dw.data(), dy.data(), x.data(),
                                    w.data(), 2, 3, 2, nullptr, x16.data(), nullptr),
               moecore::Error);
  EXPECT_THROW(linear_backward_bf16(cpu_exec(), dx.data(), dw.data(), dy.data(), x.data(),
                                    w.data(), 2, 3, 2, dy16.data(), nullptr, nullptr),
               moecore::Error);
  linear_forward_bf16(cpu_exec(), y.data(), x.data(), w.data(), 2, 3, 2, x16.data(), nullptr);
}

INSTANTIATE_TEST_SUITE_P(Paths, GemmBf16,
                         ::testing::Values(Bf16GemmPath::Native, Bf16GemmPath::Widen),
                         [](const ::testing::TestParamInfo<Bf16GemmPath>& info) {
                           return std::string(bf16_gemm_path_name(info.param));
                         });

}  // namespace
}  // namespace moecore::ops
