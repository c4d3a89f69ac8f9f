// bf16 GEMM (oneDNN matmul, shape-cached primitives) vs the plain loop on the same bf16 inputs:
// only the f32 summation order differs. Linear and grouped wrappers vs the f32 ops on the
// bf16-rounded values.
#include <gtest/gtest.h>

#include "common/testing.h"
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

TEST(GemmBf16, FastMatchesReferenceAllTransposesAndShapes) {
  struct Shape { int64_t M, N, K; };
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
          gemm_bf16(ta, tb, s.M, s.N, s.K, A.data(), lda, B.data(), ldb, beta, fast.data(), ldc);
          gemm_bf16_ref(ta, tb, s.M, s.N, s.K, A.data(), lda, B.data(), ldb, beta, ref.data(),
                        ldc);
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

TEST(GemmBf16, LinearAndGroupedMatchF32OpsOnRoundedInputs) {
  const int64_t M = 19, N = 24, K = 40;
  auto x = random_vec<float>(M * K, 4), w = random_vec<float>(N * K, 5);
  auto dy = random_vec<float>(M * N, 6);
  auto w16 = to_bf16(w);
  std::vector<bf16> x16(M * K), dy16(M * N);
  std::vector<float> y(M * N), y_ref(M * N), dx(M * K), dx_ref(M * K), dw(N * K, 0.f),
      dw_ref(N * K, 0.f);
  linear_forward_bf16(y.data(), x.data(), w16.data(), M, N, K, x16.data());
  linear_backward_bf16(dx.data(), dw.data(), dy.data(), x.data(), w16.data(), M, N, K,
                       dy16.data(), x16.data());
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
  grouped_gemm_bf16(m.data(), G, N, K, xg16.data(), wg16.data(), true, yg.data());
  grouped_gemm_wgrad_bf16(m.data(), G, N, K, dyg16.data(), xg16.data(), dwg.data());
  auto wgr = rounded(wg);
  grouped_gemm_ref<float>(m.data(), G, N, K, xr.data(), wgr.data(), true, yg_ref.data());
  grouped_gemm_wgrad_ref<float>(m.data(), G, N, K, dyr.data(), xr.data(), dwg_ref.data());
  EXPECT_TRUE(all_close(yg, yg_ref, kF32Rtol, kF32Atol));
  EXPECT_TRUE(all_close(dwg, dwg_ref, kF32Rtol, kF32Atol));
}

}  // namespace
}  // namespace moecore::ops
