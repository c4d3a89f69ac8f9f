// The LayerNorm kernels (src/ops/cuda/layernorm.cu) in the grid emulator: y, mean and rstd
// against layernorm_forward_ref and dx against layernorm_backward_ref within the dtype's tolerance
// (docs/numerics.md: the row sums' order differs); the bf16w form bitwise round_f32_to_bf16 of the
// f32 kernel's y with the same statistics. Both gains (w and the zero-centred 1 + w), NaN-poisoned
// guarded outputs, dw and db accumulated onto nonzero values, in every resume order; dw and db
// bitwise reduce_cols.cuh's association of the tokens' terms (col_reduce_model.h), dy and x aligned
// or not, in several blocks of both stages.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/col_reduce_model.h"
#include "emu/emu_testing.h"
#include "ops/cast.h"
#include "ops/layernorm.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

// One row; rows shorter than a warp; hidden not a multiple of the warp or the block; many
// elements per thread; many tokens (dw's and db's long sums).
const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {1, 1}, {1, 5}, {3, 31}, {7, 33}, {5, 100}, {4, 257}, {1, 4096}, {33, 64}, {300, 7}};

template <typename T>
void expect_close(const T* got, const T* want, int64_t n, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], kAtol<T> + kRtol<T> * std::abs(want[i])) << what << " " << i;
  }
}

std::vector<unsigned char> concat(std::vector<unsigned char> a,
                                  const std::vector<unsigned char>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

template <typename T>
void check_forward(int64_t n_tok, int64_t H, bool zero_centered) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) +
               " zero_centered=" + std::to_string(zero_centered));
  const double eps = 1e-5;
  // A mean far from 0: the centred second pass matters.
  const std::vector<T> x = random_vec<T>(n_tok * H, 81, 2.0, 5.0);
  const std::vector<T> w = random_vec<T>(H, 82, 0.5, 1.5);
  const std::vector<T> b = random_vec<T>(H, 83);
  std::vector<T> y_ref(static_cast<size_t>(n_tok * H)), mean_ref(static_cast<size_t>(n_tok)),
      rstd_ref(static_cast<size_t>(n_tok));
  ops::layernorm_forward_ref(y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(),
                             b.data(), n_tok, H, eps, zero_centered);
  Guarded<T> y(n_tok * H, T(NAN)), mean(n_tok, T(NAN)), rstd(n_tok, T(NAN));
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n_tok * H, T(NAN)), mean1(n_tok, T(NAN)), rstd1(n_tok, T(NAN));
    ops::cuda::layernorm_forward(nullptr, y1.data(), mean1.data(), rstd1.data(), x.data(), w.data(),
                                 b.data(), n_tok, H, eps, zero_centered);
    y = y1;
    mean = mean1;
    rstd = rstd1;
    return concat(
        concat(bytes_of(y1.data(), size_t(n_tok * H)), bytes_of(mean1.data(), size_t(n_tok))),
        bytes_of(rstd1.data(), size_t(n_tok)));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact() && mean.intact() && rstd.intact()) << "written outside the elements";
  expect_close(y.data(), y_ref.data(), n_tok * H, "y element");
  expect_close(mean.data(), mean_ref.data(), n_tok, "mean of row");
  expect_close(rstd.data(), rstd_ref.data(), n_tok, "rstd of row");
  if constexpr (std::is_same_v<T, float>) {
    // bf16w: the same statistics, y rounded to bf16 values, bitwise.
    Guarded<float> y16(n_tok * H, NAN), mean16(n_tok, NAN), rstd16(n_tok, NAN);
    const std::string diff16 = order_dependence([&] {
      Guarded<float> y1(n_tok * H, NAN), mean1(n_tok, NAN), rstd1(n_tok, NAN);
      ops::cuda::layernorm_forward_bf16w(nullptr, y1.data(), mean1.data(), rstd1.data(), x.data(),
                                         w.data(), b.data(), n_tok, H, eps, zero_centered);
      y16 = y1;
      mean16 = mean1;
      rstd16 = rstd1;
      return bytes_of(y1.data(), size_t(n_tok * H));
    });
    EXPECT_EQ(diff16, "");
    EXPECT_TRUE(y16.intact() && mean16.intact() && rstd16.intact());
    std::vector<float> want(static_cast<size_t>(n_tok * H));
    ops::round_f32_to_bf16_ref(want.data(), y.data(), n_tok * H);
    EXPECT_EQ(std::memcmp(y16.data(), want.data(), sizeof(float) * size_t(n_tok * H)), 0)
        << "bf16w y is not the rounded f32 y";
    EXPECT_EQ(std::memcmp(mean16.data(), mean.data(), sizeof(float) * size_t(n_tok)), 0);
    EXPECT_EQ(std::memcmp(rstd16.data(), rstd.data(), sizeof(float) * size_t(n_tok)), 0);
  }
}

// dy and x start `off` elements past a 16-byte boundary.
template <typename T>
void check_backward(int64_t n_tok, int64_t H, bool zero_centered, int64_t off = 0) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H) +
               " zero_centered=" + std::to_string(zero_centered) + " offset " +
               std::to_string(off));
  const double eps = 1e-5;
  const std::vector<T> x_padded = random_vec<T>(off + n_tok * H, 84, -3.0, 3.0);
  const std::vector<T> w = random_vec<T>(H, 85, 0.5, 1.5);
  const std::vector<T> b = random_vec<T>(H, 86);
  const std::vector<T> dy_padded = random_vec<T>(off + n_tok * H, 87);
  const T* x_ptr = x_padded.data() + off;
  const T* dy_ptr = dy_padded.data() + off;
  const std::vector<T> x(x_ptr, x_ptr + n_tok * H), dy(dy_ptr, dy_ptr + n_tok * H);
  const std::vector<T> dw0 = random_vec<T>(H, 88), db0 = random_vec<T>(H, 89);
  // The reference forward's statistics, so the backward is judged on its own.
  std::vector<T> y(static_cast<size_t>(n_tok * H)), mean(static_cast<size_t>(n_tok)),
      rstd(static_cast<size_t>(n_tok));
  ops::layernorm_forward_ref(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(),
                             n_tok, H, eps, zero_centered);
  std::vector<T> dx_ref(static_cast<size_t>(n_tok * H)), dw_ref = dw0, db_ref = db0;
  ops::layernorm_backward_ref(dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), x.data(),
                              w.data(), mean.data(), rstd.data(), n_tok, H, zero_centered);
  Guarded<T> dx(n_tok * H, T(NAN)), dw(H), db(H);
  const std::string diff = order_dependence([&] {
    Guarded<T> dx1(n_tok * H, T(NAN)), dw1(H), db1(H);
    for (int64_t h = 0; h < H; ++h) {
      dw1[h] = dw0[size_t(h)];
      db1[h] = db0[size_t(h)];
    }
    ops::cuda::layernorm_backward(nullptr, dx1.data(), dw1.data(), db1.data(), dy_ptr, x_ptr,
                                  w.data(), mean.data(), rstd.data(), n_tok, H, zero_centered);
    dx = dx1;
    dw = dw1;
    db = db1;
    return concat(concat(bytes_of(dx1.data(), size_t(n_tok * H)), bytes_of(dw1.data(), size_t(H))),
                  bytes_of(db1.data(), size_t(H)));
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(dx.intact() && dw.intact() && db.intact()) << "written outside the elements";
  expect_close(dx.data(), dx_ref.data(), n_tok * H, "dx element");
  expect_close(dw.data(), dw_ref.data(), H, "dw element");
  expect_close(db.data(), db_ref.data(), H, "db element");
  const ops::cuda::ColReducePlan plan = ops::cuda::plan_col_reduce<T>(n_tok, H, 2, "test");
  for (int64_t h = 0; h < H; ++h) {
    const auto at = [&](int64_t t) { return size_t(t * H + h); };
    const T want_w =
        dw0[size_t(h)] + emu_test::col_tree_sum<T>(plan, n_tok, [&](T& acc, int64_t t) {
          acc = acc + dy[at(t)] * ((x[at(t)] - mean[size_t(t)]) * rstd[size_t(t)]);
        });
    const T want_b =
        db0[size_t(h)] +
        emu_test::col_tree_sum<T>(plan, n_tok, [&](T& acc, int64_t t) { acc += dy[at(t)]; });
    ASSERT_EQ(std::memcmp(&dw[h], &want_w, sizeof(T)), 0)
        << "dw element " << h << ": " << dw[h] << " is not reduce_cols' association " << want_w;
    ASSERT_EQ(std::memcmp(&db[h], &want_b, sizeof(T)), 0)
        << "db element " << h << ": " << db[h] << " is not reduce_cols' association " << want_b;
  }
}

TEST(EmuKernelsLayernorm, ForwardMatchesTheReferenceInEveryOrder) {
  for (auto [n_tok, H] : kShapes) {
    for (bool zc : {false, true}) {
      check_forward<float>(n_tok, H, zc);
      check_forward<double>(n_tok, H, zc);
    }
  }
}

TEST(EmuKernelsLayernorm, BackwardMatchesTheReferenceInEveryOrder) {
  for (auto [n_tok, H] : kShapes) {
    for (bool zc : {false, true}) {
      check_backward<float>(n_tok, H, zc);
      check_backward<double>(n_tok, H, zc);
    }
  }
}

// dw and db's two stages with several blocks in each (column tiles, splits of >= 64 tokens with a
// short last one, more than 8 splits); hidden a multiple of the vector width or not; dy and x
// aligned or one element off.
TEST(EmuKernelsLayernorm, BackwardDwDbInSeveralBlocksOfBothStagesInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{600, 130}, {530, 132}, {1100, 12}};
  for (auto [n_tok, H] : shapes) {
    check_backward<float>(n_tok, H, false, 0);
    check_backward<float>(n_tok, H, true, 1);
    check_backward<double>(n_tok, H, H % 4 == 0, H % 4 == 0 ? 1 : 0);
  }
}

// No tokens: nothing written, dw and db unchanged (no launch).
TEST(EmuKernelsLayernorm, NoTokensLeaveTheGradientsUnchanged) {
  Guarded<float> dw(3, 1.5f), db(3, -2.5f);
  ops::cuda::layernorm_backward<float>(nullptr, nullptr, dw.data(), db.data(), nullptr, nullptr,
                                       nullptr, nullptr, nullptr, 0, 3, false);
  ops::cuda::layernorm_forward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      0, 3, 1e-5, false);
  EXPECT_TRUE(dw.intact() && db.intact());
  for (int64_t h = 0; h < 3; ++h) {
    EXPECT_EQ(dw[h], 1.5f);
    EXPECT_EQ(db[h], -2.5f);
  }
}

TEST(EmuKernelsLayernorm, BadArgumentsAreErrors) {
  float v = 0;
  EXPECT_THROW(
      ops::cuda::layernorm_forward<float>(nullptr, &v, &v, &v, &v, &v, &v, 1, 0, 1e-5, false),
      Error);
  EXPECT_THROW(
      ops::cuda::layernorm_forward_bf16w(nullptr, &v, &v, &v, &v, &v, &v, -1, 4, 1e-5, false),
      Error);
  EXPECT_THROW(
      ops::cuda::layernorm_backward<float>(nullptr, &v, &v, &v, &v, &v, &v, &v, &v, 1, 0, false),
      Error);
}

}  // namespace
}  // namespace moecore
