// The f32 <-> bf16 kernels (src/ops/cuda/cast.cu) in the grid emulator against their `_ref`
// oracles, bitwise: random bit patterns and the specials (signed zeros, infinities, NaNs with
// payloads and either sign, denormals, ties to even, the largest finite values that round to
// infinity), NaN-poisoned guarded outputs, in every resume order.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/cast.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;

constexpr uint16_t kBf16Nan = 0x7fc1;  // the poison of bf16 outputs (a NaN no input maps to here)

// n f32 bit patterns: the specials first, then random bits (every class: NaN, denormal, ...).
std::vector<float> f32_inputs(int64_t n, uint32_t seed) {
  const std::vector<uint32_t> specials = {
      0x00000000u, 0x80000000u,  // +-0
      0x7f800000u, 0xff800000u,  // +-inf
      0x7fc00000u, 0xffc00000u,  // quiet NaNs
      0x7f800001u, 0xff800001u,  // signalling NaNs, payload only in the low bits (quietened)
      0x7fa5a5a5u, 0x7fffffffu,  // payloads in the kept bits
      0x00000001u, 0x807fffffu,  // the smallest and the largest denormals
      0x00018000u, 0x00008000u,  // denormal ties: odd rounds up, even stays
      0x3f808000u, 0x3f818000u,  // normal ties: to even down, to even up
      0x3f808001u, 0x3f807fffu,  // just above and below a tie
      0x7f7fffffu, 0xff7fffffu,  // the largest finite values: round to +-inf
      0x7f7f7fffu, 0x7f7f8000u,  // the largest that stays finite, and the tie that overflows
  };
  std::mt19937 gen(seed);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = size_t(i) < specials.size() ? specials[size_t(i)] : uint32_t(gen());
    x[size_t(i)] = std::bit_cast<float>(u);
  }
  return x;
}

// Checks in every resume order, or in the default one alone (`orders` false: large sizes).
void check_f32_to_bf16(int64_t n, bool orders = true) {
  SCOPED_TRACE("n=" + std::to_string(n));
  const std::vector<float> x = f32_inputs(n, 31);
  std::vector<bf16> want(static_cast<size_t>(n));
  ops::cast_f32_to_bf16_ref(want.data(), x.data(), n);
  Guarded<uint16_t> y(n, kBf16Nan);
  const auto run = [&] {
    Guarded<uint16_t> fresh(n, kBf16Nan);
    ops::cuda::cast_f32_to_bf16(nullptr, reinterpret_cast<bf16*>(fresh.data()), x.data(), n);
    y = fresh;
    return bytes_of(fresh.data(), size_t(n));
  };
  if (orders)
    EXPECT_EQ(order_dependence(run), "");
  else
    run();
  EXPECT_TRUE(y.intact()) << "written outside its " << n << " elements";
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(y[i], want[size_t(i)].bits)
        << "element " << i << ": f32 bits " << std::hex << std::bit_cast<uint32_t>(x[size_t(i)]);
  }
}

void check_round_f32_to_bf16(int64_t n, bool orders = true) {
  SCOPED_TRACE("n=" + std::to_string(n));
  const std::vector<float> x = f32_inputs(n, 32);
  std::vector<float> want(static_cast<size_t>(n));
  ops::round_f32_to_bf16_ref(want.data(), x.data(), n);
  Guarded<float> y(n, NAN);
  const auto run = [&] {
    Guarded<float> fresh(n, NAN);
    ops::cuda::round_f32_to_bf16(nullptr, fresh.data(), x.data(), n);
    y = fresh;
    return bytes_of(fresh.data(), size_t(n));
  };
  if (orders)
    EXPECT_EQ(order_dependence(run), "");
  else
    run();
  EXPECT_TRUE(y.intact()) << "written outside its " << n << " elements";
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(&y[i], &want[size_t(i)], sizeof(float)), 0)
        << "element " << i << ": f32 bits " << std::hex << std::bit_cast<uint32_t>(x[size_t(i)]);
  }
  // In place (y = x).
  Guarded<float> yx(n);
  for (int64_t i = 0; i < n; ++i) yx[i] = x[size_t(i)];
  ops::cuda::round_f32_to_bf16(nullptr, yx.data(), yx.data(), n);
  EXPECT_TRUE(yx.intact());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(&yx[i], &want[size_t(i)], sizeof(float)), 0) << "in place, element " << i;
  }
}

// Sizes around the block (256 threads), and past the grid-stride cap (1056 blocks: each thread
// then converts two elements; in one order).
TEST(EmuKernelsCast, F32ToBf16MatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(22), int64_t(255), int64_t(257), int64_t(1000),
                    int64_t(4099)}) {
    check_f32_to_bf16(n);
  }
  check_f32_to_bf16(1056 * 256 + 37, /*orders=*/false);
}

TEST(EmuKernelsCast, RoundF32ToBf16MatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(22), int64_t(255), int64_t(257), int64_t(1000),
                    int64_t(4099)}) {
    check_round_f32_to_bf16(n);
  }
  check_round_f32_to_bf16(1056 * 256 + 37, /*orders=*/false);
}

// Every bf16 bit pattern (NaNs, infinities, denormals, both zeros), a tail that is not a
// multiple of the block, and past the grid-stride cap (in one order).
void check_bf16_to_f32(int64_t n, bool orders = true) {
  {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<bf16> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[size_t(i)].bits = uint16_t((i * 40503) & 0xffff);
    std::vector<float> want(static_cast<size_t>(n));
    ops::cast_bf16_to_f32_ref(want.data(), x.data(), n);
    Guarded<float> y(n, NAN);
    const auto run = [&] {
      Guarded<float> fresh(n, NAN);
      ops::cuda::cast_bf16_to_f32(nullptr, fresh.data(), x.data(), n);
      y = fresh;
      return bytes_of(fresh.data(), size_t(n));
    };
    if (orders)
      EXPECT_EQ(order_dependence(run), "");
    else
      run();
    EXPECT_TRUE(y.intact()) << "written outside its " << n << " elements";
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(&y[i], &want[size_t(i)], sizeof(float)), 0)
          << "element " << i << ": bf16 bits " << std::hex << x[size_t(i)].bits;
    }
  }
}

TEST(EmuKernelsCast, Bf16ToF32MatchesTheReferenceBitwiseOnEveryPattern) {
  for (int64_t n : {int64_t(65536), int64_t(1), int64_t(300)}) check_bf16_to_f32(n);
  check_bf16_to_f32(1056 * 256 + 37, /*orders=*/false);
  ops::cuda::cast_bf16_to_f32(nullptr, nullptr, nullptr, 0);  // no elements: no launch
}

TEST(EmuKernelsCast, NegativeSizesAreErrors) {
  float f = 0;
  bf16 b;
  EXPECT_THROW(ops::cuda::cast_f32_to_bf16(nullptr, &b, &f, -1), Error);
  EXPECT_THROW(ops::cuda::cast_bf16_to_f32(nullptr, &f, &b, -1), Error);
  EXPECT_THROW(ops::cuda::round_f32_to_bf16(nullptr, &f, &f, -2), Error);
}

}  // namespace
}  // namespace moecore
