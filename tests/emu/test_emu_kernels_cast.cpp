// The f32 <-> bf16 kernels (src/ops/cuda/cast.cu) in the grid emulator against their `_ref`
// oracles, bitwise: random bit patterns and the specials (signed zeros, infinities, NaNs with
// payloads and either sign, denormals, ties to even, the largest finite values that round to
// infinity), NaN-poisoned guarded outputs, in every resume order; on 16-byte-aligned buffers (the
// vector kernels, with tails of every length) and on buffers one element off (the scalar ones).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
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
std::vector<uint32_t> f32_inputs(int64_t n, uint32_t seed) {
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
  std::vector<uint32_t> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[size_t(i)] = size_t(i) < specials.size() ? specials[size_t(i)] : uint32_t(gen());
  return x;
}

// Runs kernel(y, x, n) on x = in[off, off + n) into a NaN-poisoned guarded y[off, off + n)
// (off = 0: both 16-byte aligned; 1: both one element off), in every resume order or in the
// default one alone (`orders` false: large sizes), and compares with want bitwise; y's elements
// before off stay poisoned. In and Out are raw bit types (uint16_t for bf16).
template <typename In, typename Out>
void check(const std::vector<In>& in_n, const std::vector<Out>& want, int64_t off, Out poison,
           const std::function<void(Out*, const In*, int64_t)>& kernel, bool orders = true) {
  const int64_t n = int64_t(in_n.size());
  SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(off));
  Guarded<In> in(n + off);  // a guarded input too: its data() is 16-byte aligned
  for (int64_t i = 0; i < n; ++i) in[off + i] = in_n[size_t(i)];
  ASSERT_EQ(reinterpret_cast<uintptr_t>(in.data()) % 16, 0u);
  Guarded<Out> y(n + off, poison);
  const auto run = [&] {
    Guarded<Out> fresh(n + off, poison);
    kernel(fresh.data() + off, in.data() + off, n);
    y = fresh;
    return bytes_of(fresh.data(), size_t(n + off));
  };
  if (orders)
    EXPECT_EQ(order_dependence(run), "");
  else
    run();
  EXPECT_TRUE(y.intact()) << "written outside its " << n << " elements";
  for (int64_t i = 0; i < off; ++i) ASSERT_EQ(y[i], poison) << "written before its first element";
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(y[off + i], want[size_t(i)])
        << "element " << i << ": input bits " << std::hex << uint32_t(in_n[size_t(i)]);
  }
}

void check_f32_to_bf16(int64_t n, int64_t off, bool orders = true) {
  const std::vector<uint32_t> x = f32_inputs(n, 31);
  std::vector<uint16_t> want(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    bf16 b;
    const float f = std::bit_cast<float>(x[size_t(i)]);
    ops::cast_f32_to_bf16_ref(&b, &f, 1);
    want[size_t(i)] = b.bits;
  }
  check<uint32_t, uint16_t>(
      x, want, off, kBf16Nan,
      [](uint16_t* y, const uint32_t* in, int64_t m) {
        ops::cuda::cast_f32_to_bf16(nullptr, reinterpret_cast<bf16*>(y),
                                    reinterpret_cast<const float*>(in), m);
      },
      orders);
}

void check_round_f32_to_bf16(int64_t n, int64_t off, bool orders = true) {
  const std::vector<uint32_t> x = f32_inputs(n, 32);
  std::vector<uint32_t> want(size_t(n), 0);
  ops::round_f32_to_bf16_ref(reinterpret_cast<float*>(want.data()),
                             reinterpret_cast<const float*>(x.data()), n);
  const uint32_t poison = std::bit_cast<uint32_t>(float(NAN));
  check<uint32_t, uint32_t>(
      x, want, off, poison,
      [](uint32_t* y, const uint32_t* in, int64_t m) {
        ops::cuda::round_f32_to_bf16(nullptr, reinterpret_cast<float*>(y),
                                     reinterpret_cast<const float*>(in), m);
      },
      orders);
  // In place (y = x).
  if (!orders) return;
  Guarded<uint32_t> yx(n + off);
  for (int64_t i = 0; i < n; ++i) yx[off + i] = x[size_t(i)];
  ops::cuda::round_f32_to_bf16(nullptr, reinterpret_cast<float*>(yx.data() + off),
                               reinterpret_cast<const float*>(yx.data() + off), n);
  EXPECT_TRUE(yx.intact());
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(yx[off + i], want[size_t(i)]) << "in place, element " << i;
}

void check_bf16_to_f32(int64_t n, int64_t off, bool orders = true) {
  // Every bf16 pattern once n >= 65536 (40503 is odd: i -> 40503 i mod 2^16 is a bijection).
  std::vector<uint16_t> x(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = uint16_t((i * 40503) & 0xffff);
  std::vector<uint32_t> want(size_t(n), 0);
  ops::cast_bf16_to_f32_ref(reinterpret_cast<float*>(want.data()),
                            reinterpret_cast<const bf16*>(x.data()), n);
  const uint32_t poison = std::bit_cast<uint32_t>(float(NAN));
  check<uint16_t, uint32_t>(
      x, want, off, poison,
      [](uint32_t* y, const uint16_t* in, int64_t m) {
        ops::cuda::cast_bf16_to_f32(nullptr, reinterpret_cast<float*>(y),
                                    reinterpret_cast<const bf16*>(in), m);
      },
      orders);
}

// Sizes with every tail length (n % 4, n % 8), around the block (256 threads of 4 or 8 elements)
// and one element off alignment (the scalar kernels); past the grid-stride cap (1056 blocks) in
// one order: each thread then takes two steps.
const std::vector<int64_t> kSizes = {0, 1, 2, 3, 5, 7, 22, 255, 1023, 1025, 2053, 4099};

TEST(EmuKernelsCast, F32ToBf16MatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n : kSizes) {
    for (int64_t off : {0, 1}) check_f32_to_bf16(n, off);
  }
  check_f32_to_bf16(4 * 1056 * 256 + 4 * 37 + 3, 0, /*orders=*/false);
  check_f32_to_bf16(1056 * 256 + 37, 1, /*orders=*/false);
}

TEST(EmuKernelsCast, RoundF32ToBf16MatchesTheReferenceBitwiseInEveryOrder) {
  for (int64_t n : kSizes) {
    for (int64_t off : {0, 1}) check_round_f32_to_bf16(n, off);
  }
  check_round_f32_to_bf16(4 * 1056 * 256 + 4 * 37 + 3, 0, /*orders=*/false);
  check_round_f32_to_bf16(1056 * 256 + 37, 1, /*orders=*/false);
}

TEST(EmuKernelsCast, Bf16ToF32MatchesTheReferenceBitwiseOnEveryPattern) {
  for (int64_t n : kSizes) {
    for (int64_t off : {0, 1}) check_bf16_to_f32(n, off);
  }
  check_bf16_to_f32(65536, 0);
  check_bf16_to_f32(65536, 1);
  check_bf16_to_f32(8 * 1056 * 256 + 8 * 37 + 7, 0, /*orders=*/false);
  check_bf16_to_f32(1056 * 256 + 37, 1, /*orders=*/false);
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
