// The RoPE kernel (src/ops/cuda/rope.cu) in the grid emulator: bitwise the CPU fast path (both
// read the same cos / sin tables) and within the dtype's tolerance of rope_forward_ref /
// rope_backward_ref, with NaN-poisoned guarded outputs, in place bitwise the same as out of place,
// and bitwise the same in every resume order; a position outside the cache gives NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/rope.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void check_rope(int64_t n_tok, int64_t n_heads, int64_t D, double base) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " heads=" + std::to_string(n_heads) +
               " D=" + std::to_string(D));
  constexpr int64_t kMaxPos = 4096;
  const ops::RopeTables cache(kMaxPos, D, base);
  const int64_t n = n_tok * n_heads * D;
  const std::vector<T> x = random_vec<T>(n, 61), dy = random_vec<T>(n, 62);
  std::vector<int32_t> pos(static_cast<size_t>(n_tok));
  for (int64_t t = 0; t < n_tok; ++t) pos[size_t(t)] = int32_t((t * 977) % kMaxPos);
  if (n_tok > 1) pos[size_t(n_tok - 1)] = kMaxPos - 1;
  std::vector<T> y_ref(static_cast<size_t>(n)), dx_ref(static_cast<size_t>(n));
  ops::rope_forward_ref(y_ref.data(), x.data(), pos.data(), n_tok, n_heads, D, base);
  ops::rope_backward_ref(dx_ref.data(), dy.data(), pos.data(), n_tok, n_heads, D, base);
  std::vector<T> y_cpu(static_cast<size_t>(n)), dx_cpu(static_cast<size_t>(n));
  ops::cpu::rope_forward(y_cpu.data(), x.data(), pos.data(), n_tok, n_heads, cache);
  ops::cpu::rope_backward(dx_cpu.data(), dy.data(), pos.data(), n_tok, n_heads, cache);
  Guarded<T> y(n), dx(n);
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(n, T(NAN)), dx1(n, T(NAN)), y_in(n), dx_in(n);
    for (int64_t i = 0; i < n; ++i) y_in[i] = x[size_t(i)], dx_in[i] = dy[size_t(i)];
    ops::cuda::rope_forward<T>(nullptr, y1.data(), x.data(), pos.data(), n_tok, n_heads, cache);
    ops::cuda::rope_backward<T>(nullptr, dx1.data(), dy.data(), pos.data(), n_tok, n_heads, cache);
    ops::cuda::rope_forward<T>(nullptr, y_in.data(), y_in.data(), pos.data(), n_tok, n_heads,
                               cache);
    ops::cuda::rope_backward<T>(nullptr, dx_in.data(), dx_in.data(), pos.data(), n_tok, n_heads,
                                cache);
    EXPECT_EQ(bytes_of(y_in.data(), size_t(n)), bytes_of(y1.data(), size_t(n))) << "y in place";
    EXPECT_EQ(bytes_of(dx_in.data(), size_t(n)), bytes_of(dx1.data(), size_t(n))) << "dx in place";
    y = y1, dx = dx1;
    std::vector<unsigned char> out = bytes_of(y1.data(), size_t(n));
    const std::vector<unsigned char> d = bytes_of(dx1.data(), size_t(n));
    out.insert(out.end(), d.begin(), d.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact() && dx.intact()) << "written outside the elements";
  EXPECT_EQ(bytes_of(y.data(), size_t(n)), bytes_of(y_cpu.data(), size_t(n))) << "y vs the CPU";
  EXPECT_EQ(bytes_of(dx.data(), size_t(n)), bytes_of(dx_cpu.data(), size_t(n))) << "dx vs the CPU";
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(y[i], y_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(y_ref[size_t(i)]))
        << "y element " << i;
    ASSERT_NEAR(dx[i], dx_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(dx_ref[size_t(i)]))
        << "dx element " << i;
  }
}

// No tokens; one pair; odd token and head counts; D not a multiple of 32; more than one block.
TEST(EmuKernelsRope, MatchesTheReferenceInEveryOrder) {
  for (auto [n_tok, n_heads, D] : std::vector<std::array<int64_t, 3>>{
           {0, 2, 8}, {1, 1, 2}, {7, 3, 8}, {33, 2, 18}, {5, 4, 128}, {300, 3, 32}}) {
    check_rope<float>(n_tok, n_heads, D, 10000.0);
    check_rope<double>(n_tok, n_heads, D, 500000.0);
  }
}

TEST(EmuKernelsRope, PositionOutsideTheCacheIsNaN) {
  const ops::RopeTables cache(8, 4, 10000.0);
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int32_t> pos = {7, 8};
  Guarded<float> y(8, 0.0f);
  ops::cuda::rope_forward<float>(nullptr, y.data(), x.data(), pos.data(), 2, 1, cache);
  for (int64_t i = 0; i < 4; ++i) EXPECT_FALSE(std::isnan(y[i])) << i;
  for (int64_t i = 4; i < 8; ++i) EXPECT_TRUE(std::isnan(y[i])) << i;
}

TEST(EmuKernelsRope, BadArgumentsAreErrors) {
  float v = 0;
  int32_t p = 0;
  EXPECT_THROW(ops::cuda::rope_forward<float>(nullptr, &v, &v, &p, 1, 1, ops::RopeCache{}), Error);
  const ops::RopeTables cache(8, 4, 10000.0);
  EXPECT_THROW(ops::cuda::rope_backward<float>(nullptr, &v, &v, &p, -1, 1, cache), Error);
}

}  // namespace
}  // namespace moecore
