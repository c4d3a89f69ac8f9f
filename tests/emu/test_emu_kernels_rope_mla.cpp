// The MLA RoPE kernel (src/ops/cuda/rope_mla.cu) in the grid emulator: bitwise the CPU path
// (both read the same factor * cos / sin tables) and within the dtype's tolerance of
// rope_mla_forward_ref / rope_mla_backward_ref, for both pairings, plain and YaRN, strided rows,
// outputs guarded with the elements outside the rotary slice left as they were, and bitwise the
// same in every resume order; a position outside the cache gives NaN.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/rope_mla.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using ops::RopePairing;
using ops::RopeType;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void check_rope_mla(int64_t n_tok, int64_t n_heads, int64_t D, int64_t ldx, int64_t ldy,
                    RopePairing pairing, RopeType type) {
  SCOPED_TRACE("tokens=" + std::to_string(n_tok) + " heads=" + std::to_string(n_heads) + " D=" +
               std::to_string(D) + " ldx=" + std::to_string(ldx) + " ldy=" + std::to_string(ldy) +
               (pairing == RopePairing::Interleaved ? " interleaved" : " half-split") +
               (type == RopeType::Yarn ? " yarn" : " rope"));
  constexpr int64_t kMaxPos = 1024;
  const ops::RopeMlaSpec spec{D, 10000.0, pairing, {type, {16.0, 128, 32.0, 1.0, 1.0, 0.5}}};
  const ops::RopeMlaTables cache(kMaxPos, spec);
  const int64_t rows = n_tok * n_heads, nx = rows * ldx, ny = rows * ldy;
  const std::vector<T> x = random_vec<T>(nx, 61), dy = random_vec<T>(ny, 62);
  const std::vector<T> y0 = random_vec<T>(ny, 63), dx0 = random_vec<T>(nx, 64);
  std::vector<int32_t> pos(static_cast<size_t>(n_tok));
  for (int64_t t = 0; t < n_tok; ++t) pos[size_t(t)] = int32_t((t * 977) % kMaxPos);
  if (n_tok > 1) pos[size_t(n_tok - 1)] = kMaxPos - 1;
  std::vector<T> y_ref = y0, dx_ref = dx0, y_cpu = y0, dx_cpu = dx0;
  ops::rope_mla_forward_ref(y_ref.data(), x.data(), pos.data(), n_tok, n_heads, ldy, ldx, spec);
  ops::rope_mla_backward_ref(dx_ref.data(), dy.data(), pos.data(), n_tok, n_heads, ldx, ldy, spec);
  ops::cpu::rope_mla_forward(y_cpu.data(), x.data(), pos.data(), n_tok, n_heads, ldy, ldx, cache);
  ops::cpu::rope_mla_backward(dx_cpu.data(), dy.data(), pos.data(), n_tok, n_heads, ldx, ldy,
                              cache);
  Guarded<T> y(ny), dx(nx);
  const std::string diff = order_dependence([&] {
    Guarded<T> y1(ny), dx1(nx);
    for (int64_t i = 0; i < ny; ++i) y1[i] = y0[size_t(i)];
    for (int64_t i = 0; i < nx; ++i) dx1[i] = dx0[size_t(i)];
    ops::cuda::rope_mla_forward<T>(nullptr, y1.data(), x.data(), pos.data(), n_tok, n_heads, ldy,
                                   ldx, cache);
    ops::cuda::rope_mla_backward<T>(nullptr, dx1.data(), dy.data(), pos.data(), n_tok, n_heads, ldx,
                                    ldy, cache);
    y = y1, dx = dx1;
    std::vector<unsigned char> out = bytes_of(y1.data(), size_t(ny));
    const std::vector<unsigned char> d = bytes_of(dx1.data(), size_t(nx));
    out.insert(out.end(), d.begin(), d.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(y.intact() && dx.intact()) << "written outside the elements";
  EXPECT_EQ(bytes_of(y.data(), size_t(ny)), bytes_of(y_cpu.data(), size_t(ny))) << "y vs the CPU";
  EXPECT_EQ(bytes_of(dx.data(), size_t(nx)), bytes_of(dx_cpu.data(), size_t(nx)))
      << "dx vs the CPU";
  for (int64_t i = 0; i < ny; ++i)
    ASSERT_NEAR(y[i], y_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(y_ref[size_t(i)]))
        << "y element " << i;
  for (int64_t i = 0; i < nx; ++i)
    ASSERT_NEAR(dx[i], dx_ref[size_t(i)], kAtol<T> + kRtol<T> * std::abs(dx_ref[size_t(i)]))
        << "dx element " << i;
}

// No tokens; one pair; odd counts with strides wider than D; MLA's 64-wide slice of a 192-wide
// head; more than one block.
TEST(EmuKernelsRopeMla, MatchesTheReferenceInEveryOrder) {
  struct Shape {
    int64_t n_tok, n_heads, D, ldx, ldy;
  };
  for (Shape s : {Shape{0, 2, 8, 8, 8}, Shape{1, 1, 2, 2, 2}, Shape{7, 3, 8, 11, 9},
                  Shape{5, 4, 64, 192, 192}, Shape{300, 3, 32, 32, 40}}) {
    for (RopePairing pairing : {RopePairing::Interleaved, RopePairing::HalfSplit}) {
      check_rope_mla<float>(s.n_tok, s.n_heads, s.D, s.ldx, s.ldy, pairing, RopeType::Yarn);
      check_rope_mla<double>(s.n_tok, s.n_heads, s.D, s.ldx, s.ldy, pairing, RopeType::Rope);
    }
  }
}

TEST(EmuKernelsRopeMla, PositionOutsideTheCacheIsNaN) {
  const ops::RopeMlaTables cache(8, ops::RopeMlaSpec{4, 10000.0, RopePairing::Interleaved, {}});
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int32_t> pos = {7, 8};
  Guarded<float> y(8, 0.0f);
  ops::cuda::rope_mla_forward<float>(nullptr, y.data(), x.data(), pos.data(), 2, 1, 4, 4, cache);
  for (int64_t i = 0; i < 4; ++i) EXPECT_FALSE(std::isnan(y[i])) << i;
  for (int64_t i = 4; i < 8; ++i) EXPECT_TRUE(std::isnan(y[i])) << i;
}

TEST(EmuKernelsRopeMla, BadArgumentsAreErrors) {
  float v = 0, w = 0;
  int32_t p = 0;
  EXPECT_THROW(
      ops::cuda::rope_mla_forward<float>(nullptr, &v, &w, &p, 1, 1, 2, 2, ops::RopeMlaCache{}),
      Error);
  const ops::RopeMlaTables cache(8, ops::RopeMlaSpec{4, 10000.0, RopePairing::Interleaved, {}});
  EXPECT_THROW(ops::cuda::rope_mla_backward<float>(nullptr, &v, &w, &p, -1, 1, 4, 4, cache), Error);
  EXPECT_THROW(ops::cuda::rope_mla_backward<float>(nullptr, &v, &w, &p, 1, 1, 2, 4, cache), Error);
}

}  // namespace
}  // namespace moecore
