// The RMSNorm backward kernels (src/ops/cuda/rmsnorm.cu) in the grid emulator against
// rmsnorm_backward_ref, within the dtype's tolerance (docs/numerics.md: the sums' order differs),
// with NaN-poisoned guarded dx, dw accumulated onto nonzero values in a guarded buffer, and
// bitwise the same in every resume order (no races, no atomics); dw bitwise reduce_cols.cuh's
// association of the tokens' terms (col_reduce_model.h), with dy and x aligned or not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/col_reduce_model.h"
#include "emu/emu_testing.h"
#include "ops/cast.h"
#include "ops/rmsnorm.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

// dy and x start `off` elements past a 16-byte boundary.
template <typename T>
void check_rmsnorm_backward(int64_t n_tok, int64_t H, int64_t off = 0) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) + " offset " +
               std::to_string(off));
  const double eps = 1e-5;
  const std::vector<T> x_padded = random_vec<T>(off + n_tok * H, 41, -3.0, 3.0);
  const std::vector<T> w = random_vec<T>(H, 42, 0.5, 1.5);
  const std::vector<T> dy_padded = random_vec<T>(off + n_tok * H, 43);
  const T* x_ptr = x_padded.data() + off;
  const T* dy_ptr = dy_padded.data() + off;
  const std::vector<T> x(x_ptr, x_ptr + n_tok * H), dy(dy_ptr, dy_ptr + n_tok * H);
  const std::vector<T> dw0 = random_vec<T>(H, 44);  // dw accumulates onto these
  // The reference forward's rstd, so the backward is judged on its own.
  std::vector<T> y(static_cast<size_t>(n_tok * H)), rstd(static_cast<size_t>(n_tok));
  ops::rmsnorm_forward_ref(y.data(), rstd.data(), x.data(), w.data(), n_tok, H, eps);
  std::vector<T> dx_ref(static_cast<size_t>(n_tok * H)), dw_ref = dw0;
  ops::rmsnorm_backward_ref(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(),
                            rstd.data(), n_tok, H);
  Guarded<T> dx(n_tok * H, T(NAN)), dw(H);
  const std::string diff = order_dependence([&] {
    Guarded<T> dx1(n_tok * H, T(NAN)), dw1(H);
    for (int64_t h = 0; h < H; ++h) dw1[h] = dw0[size_t(h)];
    ops::cuda::rmsnorm_backward(nullptr, dx1.data(), dw1.data(), dy_ptr, x_ptr, w.data(),
                                rstd.data(), n_tok, H);
    dx = dx1;
    dw = dw1;
    std::vector<unsigned char> out = bytes_of(dx1.data(), size_t(n_tok * H));
    const std::vector<unsigned char> d = bytes_of(dw1.data(), size_t(H));
    out.insert(out.end(), d.begin(), d.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(dx.intact()) << "dx written outside its elements";
  EXPECT_TRUE(dw.intact()) << "dw written outside its elements";
  for (int64_t i = 0; i < n_tok * H; ++i) {
    ASSERT_NEAR(dx[i], dx_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(dx_ref[size_t(i)]))
        << "dx element " << i;
  }
  const ops::cuda::ColReducePlan plan = ops::cuda::plan_col_reduce<T>(n_tok, H, 1, "test");
  for (int64_t h = 0; h < H; ++h) {
    ASSERT_NEAR(dw[h], dw_ref[size_t(h)], kAtol<T> + kRtol<T> * std::abs(dw_ref[size_t(h)]))
        << "dw element " << h;
    const T tree = emu_test::col_tree_sum<T>(plan, n_tok, [&](T& acc, int64_t t) {
      acc += dy[size_t(t * H + h)] * x[size_t(t * H + h)] * rstd[size_t(t)];
    });
    const T want = dw0[size_t(h)] + tree;
    ASSERT_EQ(std::memcmp(&dw[h], &want, sizeof(T)), 0)
        << "dw element " << h << ": " << dw[h] << " is not reduce_cols' association " << want;
  }
}

// One row; rows shorter than a warp; hidden not a multiple of the warp or the block (dw's
// blocks: a partial last block); many elements per thread; many tokens (dw's long sums).
TEST(EmuKernelsRmsnorm, BackwardMatchesTheReferenceInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},   {1, 5},   {3, 31},   {7, 33},
                                                           {5, 100}, {4, 257}, {1, 4096}, {3, 8191},
                                                           {33, 64}, {300, 7}};
  for (auto [n_tok, H] : shapes) {
    check_rmsnorm_backward<float>(n_tok, H);
    check_rmsnorm_backward<double>(n_tok, H);
  }
}

// dw's two stages with several blocks in each (column tiles, splits of >= 64 tokens with a short
// last one, more than 8 splits); the q/k norms' shape (many rows of a few columns: 18 splits);
// hidden a multiple of the vector width or not; dy and x aligned or one element off.
TEST(EmuKernelsRmsnorm, BackwardDwInSeveralBlocksOfBothStagesInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {600, 130}, {530, 132}, {1100, 8}, {650, 6}};
  for (auto [n_tok, H] : shapes) {
    check_rmsnorm_backward<float>(n_tok, H, 0);
    check_rmsnorm_backward<float>(n_tok, H, 1);
    check_rmsnorm_backward<double>(n_tok, H, H % 2);
  }
}

// No tokens: dx has no rows and dw is left as it was (no launch).
TEST(EmuKernelsRmsnorm, BackwardOfNoTokensLeavesDwUnchanged) {
  Guarded<float> dw(3);
  for (int64_t h = 0; h < 3; ++h) dw[h] = float(h) + 0.5f;
  ops::cuda::rmsnorm_backward<float>(nullptr, nullptr, dw.data(), nullptr, nullptr, nullptr,
                                     nullptr, 0, 3);
  EXPECT_TRUE(dw.intact());
  for (int64_t h = 0; h < 3; ++h) EXPECT_EQ(dw[h], float(h) + 0.5f);
}

TEST(EmuKernelsRmsnorm, BackwardBadArgumentsAreErrors) {
  float v = 0;
  EXPECT_THROW(ops::cuda::rmsnorm_backward<float>(nullptr, &v, &v, &v, &v, &v, &v, 1, 0), Error);
  EXPECT_THROW(ops::cuda::rmsnorm_backward<float>(nullptr, &v, &v, &v, &v, &v, &v, -1, 4), Error);
}

// The bf16w forward: bitwise round_f32_to_bf16 of the f32 kernel's y, the same rstd, in every
// resume order (the f32 kernel itself is checked against the reference in test_emu_kernels.cpp).
TEST(EmuKernelsRmsnorm, ForwardBf16wIsTheRoundedF32Forward) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},   {3, 31},   {7, 33},
                                                           {4, 257}, {1, 4096}, {300, 7}};
  for (auto [n_tok, H] : shapes) {
    SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H));
    const std::vector<float> x = random_vec<float>(n_tok * H, 45, -3.0, 3.0);
    const std::vector<float> w = random_vec<float>(H, 46, 0.5, 1.5);
    Guarded<float> y(n_tok * H, NAN), rstd(n_tok, NAN);
    ops::cuda::rmsnorm_forward(nullptr, y.data(), rstd.data(), x.data(), w.data(), n_tok, H, 1e-5);
    std::vector<float> want(static_cast<size_t>(n_tok * H));
    ops::round_f32_to_bf16_ref(want.data(), y.data(), n_tok * H);
    Guarded<float> y16(n_tok * H, NAN), rstd16(n_tok, NAN);
    const std::string diff = order_dependence([&] {
      Guarded<float> y1(n_tok * H, NAN), rstd1(n_tok, NAN);
      ops::cuda::rmsnorm_forward_bf16w(nullptr, y1.data(), rstd1.data(), x.data(), w.data(), n_tok,
                                       H, 1e-5);
      y16 = y1;
      rstd16 = rstd1;
      return bytes_of(y1.data(), size_t(n_tok * H));
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(y16.intact() && rstd16.intact()) << "written outside the elements";
    EXPECT_EQ(std::memcmp(y16.data(), want.data(), sizeof(float) * size_t(n_tok * H)), 0)
        << "bf16w y is not the rounded f32 y";
    EXPECT_EQ(std::memcmp(rstd16.data(), rstd.data(), sizeof(float) * size_t(n_tok)), 0);
  }
  float v = 0;
  EXPECT_THROW(ops::cuda::rmsnorm_forward_bf16w(nullptr, &v, &v, &v, &v, 1, 0, 1e-5), Error);
}

}  // namespace
}  // namespace moecore
