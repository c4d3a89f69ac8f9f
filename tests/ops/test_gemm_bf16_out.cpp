// The bf16-output grouped GEMMs (fc1's h under --bf16) against what they replace: the f32 grouped
// GEMM (bf16 operands, or their widened values), the f32 bias, the cast to bf16: bitwise, on both
// CPU paths, over small and bench-small-sized groups (empty and one-row ones among them), thread
// counts 1 and 2 (groups in parallel or not), both weight orientations, with and without the
// bias. And against the plain loop within bf16's rounding.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops {
namespace {

using testing::Guarded;
using testing::random_vec;

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  cast_f32_to_bf16_ref(y.data(), x.data(), static_cast<int64_t>(x.size()));
  return y;
}

std::vector<float> widened(const std::vector<bf16>& x) {
  std::vector<float> y(x.size());
  cast_bf16_to_f32_ref(y.data(), x.data(), static_cast<int64_t>(x.size()));
  return y;
}

std::vector<float> nan_ws(int64_t n) {
  return std::vector<float>(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
}

// Outputs as their raw bits, with guard words around them.
using Out = Guarded<uint16_t>;
bf16* out(Out& y) { return reinterpret_cast<bf16*>(y.data()); }

bool same_bits(const Out& a, const std::vector<bf16>& b) {
  return b.empty() || std::memcmp(a.data(), b.data(), b.size() * sizeof(bf16)) == 0;
}

class GemmBf16Out : public ::testing::TestWithParam<Bf16GemmPath> {
 protected:
  void SetUp() override {
    chosen_ = bf16_gemm_path();
    threads0_ = omp_get_max_threads();
    if (GetParam() == Bf16GemmPath::Native && !bf16_native_available()) {
      GTEST_SKIP() << "native bf16 path not run: oneDNN runs below AVX-512 here (no bf16 matmul)";
    }
    set_bf16_gemm_path(GetParam());
  }
  void TearDown() override {
    set_bf16_gemm_path(chosen_);
    omp_set_num_threads(threads0_);
  }

 private:
  Bf16GemmPath chosen_ = Bf16GemmPath::Native;
  int threads0_ = 1;
};

struct Case {
  std::vector<int64_t> m_G;
  int64_t N, K;
};

TEST_P(GemmBf16Out, BitwiseTheF32ProductPlusBiasThenCast) {
  const std::vector<Case> cases = {
      {{1}, 24, 40},
      {{129}, 48, 40},
      {{0, 129, 1, 0, 257, 3}, 32, 64},
      {{7, 2}, 64, 2304},  // K past oneDNN's K blocking
      {{0, 0, 0}, 16, 24},
      // bench-small's fc1 (H 512, F1 1024): the shared expert's 2048 rows, routed experts' loads.
      {{2048}, 1024, 512},
      {{300, 200, 0, 260, 1}, 1024, 512},
  };
  for (const Case& c : cases) {
    const int64_t G = static_cast<int64_t>(c.m_G.size()), N = c.N, K = c.K;
    int64_t rows = 0;
    for (int64_t r : c.m_G) rows += r;
    const auto x16 = to_bf16(random_vec<float>(rows * K, 21));
    const auto w16 = to_bf16(random_vec<float>(G * N * K, 22));
    const auto bias = random_vec<float>(G * N, 23);
    const auto x32 = widened(x16), w32 = widened(w16);
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      for (bool trans_w : {true, false}) {
        for (bool with_bias : {true, false}) {
          SCOPED_TRACE(::testing::Message() << "G=" << G << " rows=" << rows << " N=" << N
                                            << " K=" << K << " threads=" << threads
                                            << " trans_w=" << trans_w << " bias=" << with_bias);
          const float* b = with_bias ? bias.data() : nullptr;
          // What the MLP did before: the f32 products, the bias, the cast.
          std::vector<float> y32(rows * N), y32w(rows * N);
          auto gws = nan_ws(grouped_gemm_bf16_workspace_elems(cpu_exec(), rows, N, K, threads));
          grouped_gemm_bf16(cpu_exec(), c.m_G.data(), G, N, K, x16.data(), w16.data(), trans_w,
                            y32.data(), gws.data());
          grouped_gemm<float>(cpu_exec(), c.m_G.data(), G, N, K, x32.data(), w32.data(), trans_w,
                              y32w.data());
          std::vector<bf16> want(rows * N), want_w(rows * N);
          if (with_bias) {
            grouped_bias_forward<float>(cpu_exec(), y32.data(), b, nullptr, c.m_G.data(), G, N);
            grouped_bias_forward<float>(cpu_exec(), y32w.data(), b, nullptr, c.m_G.data(), G, N);
          }
          cast_f32_to_bf16(cpu_exec(), want.data(), y32.data(), rows * N);
          cast_f32_to_bf16(cpu_exec(), want_w.data(), y32w.data(), rows * N);

          // The f32 memory lent for the products starts as NaN (what another use left there).
          Out y(rows * N), y_w32(rows * N), y_wid(rows * N);
          auto h32 = nan_ws(rows * N);
          grouped_gemm_bf16_out(cpu_exec(), c.m_G.data(), G, N, K, rows, x16.data(), w16.data(),
                                trans_w, b, out(y), h32.data(), gws.data());
          h32 = nan_ws(rows * N);
          grouped_gemm_bf16_out(cpu_exec(), c.m_G.data(), G, N, K, rows, x16.data(), w16.data(),
                                trans_w, b, out(y_w32), h32.data(), gws.data(), w32.data());
          h32 = nan_ws(rows * N);
          grouped_gemm_widened_bf16_out(cpu_exec(), c.m_G.data(), G, N, K, rows, x32.data(),
                                        w32.data(), trans_w, b, out(y_wid), h32.data());
          EXPECT_TRUE(y.intact() && y_w32.intact() && y_wid.intact());
          EXPECT_TRUE(same_bits(y, want));
          EXPECT_TRUE(same_bits(y_w32, want));
          EXPECT_TRUE(same_bits(y_wid, want_w));

          // The plain loop: its f32 sums may differ from the library's in the last bits, so the
          // rounded values by at most one bf16 step (2^-7 relative) plus f32's error on K terms.
          if (rows * N * K > (int64_t{1} << 26)) continue;  // the loop takes seconds there
          std::vector<bf16> ref(rows * N);
          grouped_gemm_bf16_out_ref(c.m_G.data(), G, N, K, x16.data(), w16.data(), trans_w, b,
                                    ref.data());
          int bad = 0;
          for (int64_t i = 0; i < rows * N && bad < 5; ++i) {
            const float got = bf16_to_float(out(y)[i]), exp = bf16_to_float(ref[i]);
            if (std::abs(got - exp) > 0.0079f * std::abs(exp) + 1e-6f * static_cast<float>(K)) {
              ADD_FAILURE() << "element " << i << ": " << got << " vs the loop's " << exp;
              ++bad;
            }
          }
        }
      }
    }
  }
}

// K = 0: every product is 0, so h = bf16(bias) (0 without it).
TEST_P(GemmBf16Out, EmptyProductsGiveTheRoundedBias) {
  const std::vector<int64_t> m = {2, 0, 3};
  const int64_t G = 3, N = 5, rows = 5;
  const std::vector<float> bias = {1.f / 3, -0.f, 2.5f, -7.1f, 1e-3f, 0.3f, 0.2f, 0.1f, -1.f, 9.f,
                                   4.f, 1.0001f, -2.f, 3.f, 1.f};
  for (const float* b : {bias.data(), static_cast<const float*>(nullptr)}) {
    Out y(rows * N), yw(rows * N);
    auto h32 = nan_ws(rows * N);
    grouped_gemm_bf16_out(cpu_exec(), m.data(), G, N, 0, rows, nullptr, nullptr, true, b, out(y),
                          h32.data(), nullptr);
    h32 = nan_ws(rows * N);
    grouped_gemm_widened_bf16_out(cpu_exec(), m.data(), G, N, 0, rows, nullptr, nullptr, true, b,
                                  out(yw), h32.data());
    int64_t row = 0;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t i = 0; i < m[g]; ++i, ++row) {
        for (int64_t j = 0; j < N; ++j) {
          const bf16 want = float_to_bf16(b != nullptr ? 0.f + b[g * N + j] : 0.f);
          EXPECT_EQ(y[row * N + j], want.bits) << row << "," << j;
          EXPECT_EQ(yw[row * N + j], want.bits) << row << "," << j;
        }
      }
    }
    EXPECT_TRUE(y.intact() && yw.intact());
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, GemmBf16Out,
                         ::testing::Values(Bf16GemmPath::Native, Bf16GemmPath::Widen),
                         [](const ::testing::TestParamInfo<Bf16GemmPath>& info) {
                           return std::string(bf16_gemm_path_name(info.param));
                         });

}  // namespace
}  // namespace moecore::ops
