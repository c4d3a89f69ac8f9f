// The numeric guard's ops: the non-finite flag against its plain loop on awkward sizes (0, 1,
// odd, one above the 2^15-element block the fast path threads over) with NaN / +-Inf at the
// first, last and a block-boundary element, guard bytes intact, the same at any thread count;
// the threshold flag at, above and below its threshold (finite values only); the veto that
// turns any raised flag into a skipped update and leaves the step's other scalars alone.
#include <omp.h>

#include <cstring>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "ops/numeric_guard.h"

namespace moecore::ops {
namespace {

using testing::Guarded;

template <typename T>
void check_flag_nonfinite() {
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{33}, int64_t{32769},
                    int64_t{3 * 32768 + 5}}) {
    const auto v = testing::random_vec<T>(n, 5, -1e30, 1e30);  // large but finite
    for (int64_t at : {int64_t{-1}, int64_t{0}, n / 2, n - 1, int64_t{32768}}) {
      if (at >= n) continue;
      for (T bad : {nan, inf, -inf}) {
        Guarded<T> x(n);
        for (int64_t i = 0; i < n; ++i) x[i] = v[i];
        if (at >= 0) x[at] = bad;
        for (int threads : {1, 3}) {
          omp_set_num_threads(threads);
          for (int32_t start : {0, 1}) {
            SCOPED_TRACE(::testing::Message() << "n=" << n << " at=" << at << " bad=" << bad
                                            << " threads=" << threads << " start=" << start);
            Guarded<int32_t> flag(1, start);
            int32_t want = start;
            flag_nonfinite<T>(cpu_exec(), flag.data(), x.data(), n);
            flag_nonfinite_ref(&want, x.data(), n);
            EXPECT_EQ(flag[0], want);
            // An OR: a raised flag stays raised; a bad element raises it.
            EXPECT_EQ(want, at >= 0 ? 1 : start);
            EXPECT_TRUE(flag.intact());
            EXPECT_TRUE(x.intact());
          }
        }
        omp_set_num_threads(1);
        if (at < 0) break;
      }
    }
  }
}

TEST(NumericGuardOps, FlagNonfiniteFastEqualsRefF32) { check_flag_nonfinite<float>(); }
TEST(NumericGuardOps, FlagNonfiniteFastEqualsRefF64) { check_flag_nonfinite<double>(); }

// Denormals, the largest finite values and -0 are finite: nothing is flagged.
TEST(NumericGuardOps, FlagNonfiniteLeavesExtremeFiniteValues) {
  const float xs[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                      std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f};
  int32_t flag = 0, ref = 0;
  flag_nonfinite<float>(cpu_exec(), &flag, xs, 5);
  flag_nonfinite_ref(&ref, xs, 5);
  EXPECT_EQ(flag, 0);
  EXPECT_EQ(ref, 0);
}

TEST(NumericGuardOps, FlagAtLeastComparesFiniteMagnitudes) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    double value, threshold;
    int32_t want;
  };
  const Case cases[] = {{5, inf, 0},   {5, 5, 1},   {-5, 5, 1},  {4.999, 5, 0}, {nan, 0, 0},
                        {inf, 0, 0},   {-inf, 1, 0}, {0, 0, 1},  {1e300, 1e299, 1}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.value << " vs " << c.threshold);
    int32_t flag = 0, ref = 0;
    flag_at_least(cpu_exec(), &flag, &c.value, &c.threshold);
    flag_at_least_ref(&ref, &c.value, &c.threshold);
    EXPECT_EQ(flag, c.want);
    EXPECT_EQ(ref, c.want);
    int32_t raised = 1;
    flag_at_least(cpu_exec(), &raised, &c.value, &c.threshold);
    EXPECT_EQ(raised, 1);
  }
}

TEST(NumericGuardOps, SkipIfFlaggedVetoesTheUpdateOnly) {
  const std::vector<std::vector<int32_t>> cases = {{}, {0}, {1}, {0, 0, 0}, {0, 0, 1}, {3, 0}};
  for (const auto& flags : cases) {
    for (int32_t start : {0, 1}) {
      AdamWStep s, ref;
      s.lr = ref.lr = 0.5;
      s.step = ref.step = 9;
      s.grad_scale = ref.grad_scale = 0.125;
      s.skip = ref.skip = start;
      const int64_t n = static_cast<int64_t>(flags.size());
      skip_if_flagged(cpu_exec(), &s, flags.data(), n);
      skip_if_flagged_ref(&ref, flags.data(), n);
      EXPECT_EQ(s.skip, ref.skip);
      bool any = start != 0;
      for (int32_t f : flags) any = any || f != 0;
      EXPECT_EQ(s.skip, any ? 1 : 0);
      EXPECT_EQ(s.lr, 0.5);
      EXPECT_EQ(s.step, 9);
      EXPECT_EQ(s.grad_scale, 0.125);
    }
  }
}

}  // namespace
}  // namespace moecore::ops
