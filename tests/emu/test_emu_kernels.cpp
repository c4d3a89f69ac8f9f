// The kernels of src/ops/cuda/, compiled as C++ with the grid emulator, against their ops' `_ref`
// oracles on awkward shapes, with guarded NaN-filled outputs, and bitwise the same in every
// resume order (no races, deterministic).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/add.h"
#include "ops/rmsnorm.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

// Checks in every resume order, or in the default one alone (`orders` false: large sizes).
template <typename T>
void check_add(int64_t n, bool orders = true) {
  SCOPED_TRACE("n=" + std::to_string(n));
  const std::vector<T> a = random_vec<T>(n, 11), b = random_vec<T>(n, 12);
  std::vector<T> want(static_cast<size_t>(n));
  ops::add_ref(want.data(), a.data(), b.data(), n);
  Guarded<T> y(n, T(NAN));
  const auto run = [&] {
    Guarded<T> fresh(n, T(NAN));
    ops::cuda::add(nullptr, fresh.data(), a.data(), b.data(), n);
    y = fresh;
    return bytes_of(fresh.data(), size_t(n));
  };
  if (orders)
    EXPECT_EQ(order_dependence(run), "");
  else
    run();
  EXPECT_TRUE(y.intact()) << "written outside its " << n << " elements";
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(&y[i], &want[size_t(i)], sizeof(T)), 0) << "element " << i;  // exact
  }
  // y aliasing a.
  Guarded<T> ya(n);
  for (int64_t i = 0; i < n; ++i) ya[i] = a[size_t(i)];
  ops::cuda::add(nullptr, ya.data(), ya.data(), b.data(), n);
  EXPECT_TRUE(ya.intact());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ya[i], want[size_t(i)]) << "aliased, element " << i;
}

// Sizes around the block (256 threads), and past the grid-stride cap (1056 blocks: each thread
// then adds two elements; in one order, as 270k fibers take a while).
TEST(EmuKernels, AddMatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n :
       {int64_t(0), int64_t(1), int64_t(31), int64_t(255), int64_t(257), int64_t(1000)}) {
    check_add<float>(n);
    check_add<double>(n);
  }
  check_add<float>(1056 * 256 + 37, /*orders=*/false);
}

template <typename T>
void check_rmsnorm(int64_t n_tok, int64_t H) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " hidden=" + std::to_string(H));
  const double eps = 1e-5;
  const std::vector<T> x = random_vec<T>(n_tok * H, 21, -3.0, 3.0);
  const std::vector<T> w = random_vec<T>(H, 22, 0.5, 1.5);
  std::vector<T> y_ref(static_cast<size_t>(n_tok * H)), rstd_ref(static_cast<size_t>(n_tok));
  ops::rmsnorm_forward_ref(y_ref.data(), rstd_ref.data(), x.data(), w.data(), n_tok, H, eps);
  Guarded<T> y(n_tok * H, T(NAN)), rstd(n_tok, T(NAN));
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n_tok * H, T(NAN)), rstd1(n_tok, T(NAN));
    ops::cuda::rmsnorm_forward(nullptr, y1.data(), rstd1.data(), x.data(), w.data(), n_tok, H, eps);
    y = y1;
    rstd = rstd1;
    std::vector<unsigned char> out = bytes_of(y1.data(), size_t(n_tok * H));
    const std::vector<unsigned char> r = bytes_of(rstd1.data(), size_t(n_tok));
    out.insert(out.end(), r.begin(), r.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact()) << "y written outside its elements";
  EXPECT_TRUE(rstd.intact()) << "rstd written outside its elements";
  for (int64_t t = 0; t < n_tok; ++t) {
    ASSERT_NEAR(rstd[t], rstd_ref[size_t(t)], kAtol<T> + kRtol<T> * std::abs(rstd_ref[size_t(t)]))
        << "rstd of token " << t;
  }
  for (int64_t i = 0; i < n_tok * H; ++i) {
    ASSERT_NEAR(y[i], y_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(y_ref[size_t(i)]))
        << "y element " << i;
  }
}

// One row; rows shorter than a warp; hidden not a multiple of the warp or the block; a hidden
// size that gives every thread many elements.
TEST(EmuKernels, RmsnormForwardMatchesTheReferenceInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {1, 5}, {3, 31}, {7, 33}, {5, 100}, {4, 257}, {1, 4096}, {3, 8191}, {33, 64}};
  for (auto [n_tok, H] : shapes) {
    check_rmsnorm<float>(n_tok, H);
    check_rmsnorm<double>(n_tok, H);
  }
  check_rmsnorm<float>(0, 64);  // no rows: no launch
}

TEST(EmuKernels, BadArgumentsAreErrors) {
  float v = 0;
  EXPECT_THROW(ops::cuda::add<float>(nullptr, &v, &v, &v, -1), Error);
  EXPECT_THROW(ops::cuda::rmsnorm_forward<float>(nullptr, &v, &v, &v, &v, 1, 0, 1e-5), Error);
}

}  // namespace
}  // namespace moecore
