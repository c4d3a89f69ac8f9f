// The AdamW kernel (src/ops/cuda/adamw.cu) in the grid emulator: the new p, m, v against adamw_ref
// within the dtype's tolerance and against the CPU fast path (the same element arithmetic;
// bitwise unless the compilers contract differently, so within one f32 rounding here), the bf16
// copies bitwise the cast of the new p, the step's scalars read from memory (grad_scale, skip),
// NaN-poisoned guarded copies, and bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/adamw.h"
#include "ops/cast.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void expect_near(const T* got, const T* want, int64_t n, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], kAtol<T> + kRtol<T> * std::abs(double(want[i])))
        << what << " element " << i;
  }
}

struct Result {
  std::vector<unsigned char> bytes;  // p, m, v, p16, p16w
};

// One step from the same state on the emulated kernel; copies: 0 none, 1 p16, 2 p16w, 3 both.
template <typename T>
void check_step(int64_t n, int copies, int64_t step, double scale) {
  SCOPED_TRACE("n=" + std::to_string(n) + " copies=" + std::to_string(copies) +
               " step=" + std::to_string(step) + " grad_scale=" + std::to_string(scale));
  const ops::AdamWParams a{0.9, 0.95, 1e-8, 0.1};
  const ops::AdamWStep s{3e-3, step, scale, 0};
  const std::vector<T> p0 = random_vec<T>(n, 81, -1.0, 1.0), g = random_vec<T>(n, 82, -2.0, 2.0);
  const std::vector<float> m0 = random_vec<float>(n, 83, -0.1, 0.1),
                           v0 = random_vec<float>(n, 84, 0.0, 0.01);
  const bool want16 = copies & 1, wantw = copies & 2;

  std::vector<T> p_ref = p0;
  std::vector<float> m_ref = m0, v_ref = v0;
  ops::adamw_step_ref(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, a, s);
  std::vector<T> p_cpu = p0;
  std::vector<float> m_cpu = m0, v_cpu = v0;
  ops::cpu::adamw_step(p_cpu.data(), g.data(), m_cpu.data(), v_cpu.data(), n, a, &s);

  Guarded<T> p(n);
  Guarded<float> m(n), v(n), p16w(wantw ? n : 0, NAN);
  Guarded<uint16_t> p16(want16 ? n : 0, uint16_t(0x7fc1));  // a NaN's bits
  EXPECT_EQ(order_dependence([&] {
              std::copy(p0.begin(), p0.end(), p.data());
              std::copy(m0.begin(), m0.end(), m.data());
              std::copy(v0.begin(), v0.end(), v.data());
              for (int64_t i = 0; i < p16w.size(); ++i) p16w[i] = NAN;
              for (int64_t i = 0; i < p16.size(); ++i) p16[i] = 0x7fc1;
              ops::cuda::adamw_step(nullptr, p.data(), g.data(), m.data(), v.data(), n, a, &s,
                                    want16 ? reinterpret_cast<bf16*>(p16.data()) : nullptr,
                                    wantw ? p16w.data() : nullptr);
              std::vector<unsigned char> out = bytes_of(p.data(), size_t(n));
              for (const Guarded<float>* x : {&m, &v, &p16w}) {
                const auto b = bytes_of(x->data(), size_t(x->size()));
                out.insert(out.end(), b.begin(), b.end());
              }
              const auto b = bytes_of(p16.data(), size_t(p16.size()));
              out.insert(out.end(), b.begin(), b.end());
              return out;
            }),
            "");
  EXPECT_TRUE(p.intact() && m.intact() && v.intact() && p16.intact() && p16w.intact())
      << "written outside the elements";
  expect_near(p.data(), p_ref.data(), n, "p vs adamw_ref");
  expect_near(m.data(), m_ref.data(), n, "m vs adamw_ref");
  expect_near(v.data(), v_ref.data(), n, "v vs adamw_ref");
  // The CPU fast path's arithmetic: m and v are products and sums the compilers may contract
  // differently, so one f32 rounding of their scale apart at most.
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], p_cpu[size_t(i)], 4 * std::numeric_limits<float>::epsilon() *
                                            (std::abs(double(p_cpu[size_t(i)])) + 1e-3))
        << "p vs the CPU fast path, element " << i;
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) {
      if (want16) {
        ASSERT_EQ(p16[i], ops::f32_to_bf16_bits(p[i])) << "p16 element " << i;
      }
      if (wantw) {
        const float w = ops::f32_bf16_rounded(p[i]);
        ASSERT_EQ(std::memcmp(&p16w[i], &w, sizeof w), 0) << "p16w element " << i;
      }
    }
  }
}

// Empty, one element, not a multiple of the warp, more than one block (256 threads); the first
// step (bias correction largest) and a later one; a clipping scale.
TEST(EmuKernelsAdamW, MatchesTheReferenceInEveryOrder) {
  for (int64_t n : {0, 1, 33, 257, 1000}) {
    for (int copies : {0, 1, 2, 3}) check_step<float>(n, copies, 1, 1.0);
    check_step<float>(n, 3, 7, 0.25);
    check_step<double>(n, 0, 1, 1.0);
    check_step<double>(n, 0, 7, 0.25);
  }
}

// skip (from grad_clip or a guard, in device memory): nothing is written, the copies included.
TEST(EmuKernelsAdamW, SkipLeavesEverythingAsItIs) {
  const int64_t n = 300;
  const ops::AdamWParams a;
  const ops::AdamWStep s{1e-3, 2, 1.0, 1};
  const std::vector<float> g = random_vec<float>(n, 85);
  Guarded<float> p(n, 0.5f), m(n, 0.25f), v(n, 0.125f), p16w(n, NAN);
  Guarded<uint16_t> p16(n, uint16_t(7));
  ops::cuda::adamw_step(nullptr, p.data(), g.data(), m.data(), v.data(), n, a, &s,
                        reinterpret_cast<bf16*>(p16.data()), p16w.data());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(p[i], 0.5f);
    ASSERT_EQ(m[i], 0.25f);
    ASSERT_EQ(v[i], 0.125f);
    ASSERT_EQ(p16[i], 7);
    ASSERT_TRUE(std::isnan(p16w[i]));
  }
}

TEST(EmuKernelsAdamW, BadArgumentsAreErrors) {
  float p = 0, g = 0, m = 0, v = 0;
  double pd = 0, gd = 0;
  float w = 0;
  const ops::AdamWStep s;
  EXPECT_THROW(ops::cuda::adamw_step<float>(nullptr, &p, &g, &m, &v, -1, {}, &s, nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::adamw_step<float>(nullptr, &p, &g, &m, &v, 1, {}, nullptr, nullptr,
                                            nullptr),
               Error);
  EXPECT_THROW(ops::cuda::adamw_step<float>(nullptr, &p, &g, &m, &v, 1, {1.0, 0.9, 1e-8, 0}, &s,
                                            nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::adamw_step<float>(nullptr, &p, &g, &m, &v, 1, {0.9, 0.9, 0.0, 0}, &s,
                                            nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::adamw_step<double>(nullptr, &pd, &gd, &m, &v, 1, {}, &s, nullptr, &w),
               Error);
}

}  // namespace
}  // namespace moecore
