// Dropout with keep bits drawn from (key, iteration, sample, position, column): the kept fraction,
// the scale, fast == reference bitwise on awkward shapes (in place too), any thread count, the
// mask as a function of the global sample / position alone, p = 0 as the identity, and the
// backward against fp64 finite differences.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "ops/dropout.h"

namespace moecore::testing {
namespace {

using ops::DropoutCounters;

struct Shape {
  int64_t S, B, C, s0;
};
// Empty, one element, C below and across a 4-column Philox block and the 64-column chunk, odd
// sizes, a first position past 0, one shape above the OpenMP threshold (2^14 elements).
const Shape kShapes[] = {{0, 2, 5, 0},  {3, 0, 5, 0},   {1, 1, 1, 0},  {1, 1, 3, 0},
                         {7, 3, 37, 0}, {5, 2, 130, 9}, {2, 5, 64, 1}, {64, 3, 101, 0}};

const uint64_t kKey = rng_key(1234, "decoder.layers.0.hidden_dropout");
const DropoutCounters kCounters{17, 40};

template <typename T>
bool same_bits(const T* a, const T* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

template <typename T>
void fast_matches_ref_bitwise(double p) {
  uint32_t seed = 10;
  for (auto [S, B, C, s0] : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << "S=" << S << " B=" << B << " C=" << C << " s0=" << s0 << " p=" << p);
    const int64_t n = S * B * C;
    const auto x = random_vec<T>(n, seed++), res = random_vec<T>(n, seed++);
    std::vector<T> y_r(n), a_r(n), dx_r(n);
    ops::dropout_forward_ref(y_r.data(), x.data(), p, kKey, &kCounters, S, B, C, s0);
    ops::dropout_add_forward_ref(a_r.data(), res.data(), x.data(), p, kKey, &kCounters, S, B, C,
                                 s0);
    ops::dropout_backward_ref(dx_r.data(), x.data(), p, kKey, &kCounters, S, B, C, s0);
    const T nan = std::numeric_limits<T>::quiet_NaN();
    Guarded<T> y(n, nan), a(n, nan), dx(n, nan), y_in(n), a_in(n), dx_in(n);
    ops::dropout_forward<T>(cpu_exec(), y.data(), x.data(), p, kKey, &kCounters, S, B, C, s0);
    ops::dropout_add_forward<T>(cpu_exec(), a.data(), res.data(), x.data(), p, kKey, &kCounters, S,
                                B, C, s0);
    ops::dropout_backward<T>(cpu_exec(), dx.data(), x.data(), p, kKey, &kCounters, S, B, C, s0);
    // In place: y over x, y over the residual, dx over dy.
    std::copy(x.begin(), x.end(), y_in.data());
    std::copy(res.begin(), res.end(), a_in.data());
    std::copy(x.begin(), x.end(), dx_in.data());
    ops::dropout_forward<T>(cpu_exec(), y_in.data(), y_in.data(), p, kKey, &kCounters, S, B, C, s0);
    ops::dropout_add_forward<T>(cpu_exec(), a_in.data(), a_in.data(), x.data(), p, kKey, &kCounters,
                                S, B, C, s0);
    ops::dropout_backward<T>(cpu_exec(), dx_in.data(), dx_in.data(), p, kKey, &kCounters, S, B, C,
                             s0);
    EXPECT_TRUE(same_bits(y.data(), y_r.data(), n)) << "y";
    EXPECT_TRUE(same_bits(a.data(), a_r.data(), n)) << "y (add)";
    EXPECT_TRUE(same_bits(dx.data(), dx_r.data(), n)) << "dx";
    EXPECT_TRUE(same_bits(y_in.data(), y_r.data(), n)) << "y in place";
    EXPECT_TRUE(same_bits(a_in.data(), a_r.data(), n)) << "y (add) in place";
    EXPECT_TRUE(same_bits(dx_in.data(), dx_r.data(), n)) << "dx in place";
    for (auto* g : {&y, &a, &dx, &y_in, &a_in, &dx_in}) EXPECT_TRUE(g->intact());
  }
}

TEST(Dropout, FastMatchesRefBitwise) {
  for (double p : {0.0, 0.1, 0.5, 0.9}) {
    fast_matches_ref_bitwise<float>(p);
    fast_matches_ref_bitwise<double>(p);
  }
}

TEST(Dropout, ThresholdIsFloorOfPTimes2To32) {
  EXPECT_EQ(ops::dropout_threshold(0.0), 0u);
  EXPECT_EQ(ops::dropout_threshold(0.5), 0x80000000u);
  EXPECT_EQ(ops::dropout_threshold(0.1), 429496729u);  // 0.1 * 2^32 = 429496729.6
  EXPECT_EQ(ops::dropout_threshold(std::nextafter(1.0, 0.0)), 0xFFFFFFFFu);
}

// Each element is kept with probability 1 - p independently: the count of kept elements is
// Binomial(n, 1 - p); 5 standard deviations. Kept values are x * scale exactly, dropped ones 0.
TEST(Dropout, KeptFractionAndScale) {
  const int64_t S = 96, B = 3, C = 257, n = S * B * C;
  // x in [1, 2]: never 0, so a 0 in y means dropped.
  const auto x = random_vec<float>(n, 3, 1.0, 2.0);
  for (double p : {0.1, 0.5}) {
    SCOPED_TRACE(::testing::Message() << "p=" << p);
    std::vector<float> y(n);
    ops::dropout_forward<float>(cpu_exec(), y.data(), x.data(), p, kKey, &kCounters, S, B, C, 0);
    const float scale = ops::dropout_scale<float>(p);
    EXPECT_EQ(scale, static_cast<float>(1.0 / (1.0 - p)));
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (y[i] != 0.0f) {
        ++kept;
        ASSERT_EQ(y[i], x[i] * scale) << i;
      }
    }
    const double mean = n * (1 - p), sd = std::sqrt(n * p * (1 - p));
    EXPECT_LE(std::abs(kept - mean), 5 * sd) << kept << " kept of " << n;
  }
}

// The bit of (s, b, c) is dropout_keep(key, iteration, sample0 + b, s0 + s, c): y over x = 1
// spells out the mask.
std::vector<float> mask_of(double p, uint64_t key, const DropoutCounters& c, int64_t S, int64_t B,
                           int64_t C, int64_t s0) {
  std::vector<float> ones(S * B * C, 1.0f), y(S * B * C);
  ops::dropout_forward<float>(cpu_exec(), y.data(), ones.data(), p, key, &c, S, B, C, s0);
  for (float& v : y) v = v != 0.0f ? 1.0f : 0.0f;
  return y;
}

TEST(Dropout, MaskFollowsTheDocumentedKeepBit) {
  const int64_t S = 5, B = 2, C = 70, s0 = 3;
  const double p = 0.3;
  const auto m = mask_of(p, kKey, kCounters, S, B, C, s0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < C; ++c) {
        const bool keep = ops::dropout_keep(kKey, 17, 40 + b, s0 + s, c, ops::dropout_threshold(p));
        ASSERT_EQ(m[(s * B + b) * C + c], keep ? 1.0f : 0.0f) << s << " " << b << " " << c;
      }
    }
  }
}

// A sample gets the same mask wherever the layout puts it: column 0 of a micro-batch that
// starts at sample k, or column 1 of one that starts at k - 1; rows s0.. of a sequence split.
TEST(Dropout, MaskIsAFunctionOfSamplePositionAndColumn) {
  const int64_t S = 9, C = 77, k = 6;
  const double p = 0.5;
  const auto alone = mask_of(p, kKey, {17, k}, S, 1, C, 0);
  const auto second = mask_of(p, kKey, {17, k - 1}, S, 2, C, 0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t c = 0; c < C; ++c) {
      ASSERT_EQ(alone[s * C + c], second[(s * 2 + 1) * C + c]) << s << " " << c;
    }
  }
  const auto tail = mask_of(p, kKey, {17, k}, 4, 1, C, 5);  // positions 5..8
  for (int64_t i = 0; i < 4 * C; ++i) ASSERT_EQ(tail[i], alone[5 * C + i]) << i;
  // The other column of the pair does differ (the check above is not vacuous).
  int64_t differ = 0;
  for (int64_t i = 0; i < S * C; ++i) differ += alone[i] != second[(i / C * 2) * C + i % C];
  EXPECT_GT(differ, S * C / 4);
}

// Another key (another dropout site) or another iteration: an independent mask, differing in
// about 2 p (1 - p) of the elements.
TEST(Dropout, KeysAndIterationsGiveOtherMasks) {
  const int64_t S = 40, B = 2, C = 100, n = S * B * C;
  const double p = 0.1;
  const auto base = mask_of(p, kKey, kCounters, S, B, C, 0);
  const auto other_key =
      mask_of(p, rng_key(1234, "decoder.layers.1.hidden_dropout"), kCounters, S, B, C, 0);
  const auto other_iter = mask_of(p, kKey, {18, 40}, S, B, C, 0);
  for (const auto* m : {&other_key, &other_iter}) {
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += (*m)[i] != base[i];
    const double q = 2 * p * (1 - p), mean = n * q, sd = std::sqrt(n * q * (1 - q));
    EXPECT_LE(std::abs(differ - mean), 5 * sd) << differ << " of " << n << " differ";
  }
}

TEST(Dropout, SameBitsForAnyThreadCount) {
  const int64_t S = 64, B = 3, C = 131, n = S * B * C;
  const auto x = random_vec<float>(n, 5), res = random_vec<float>(n, 6);
  std::vector<float> y1(n), a1(n), d1(n);
  {
    ScopedOmpThreads one(1);
    ops::dropout_forward<float>(cpu_exec(), y1.data(), x.data(), 0.2, kKey, &kCounters, S, B, C, 0);
    ops::dropout_add_forward<float>(cpu_exec(), a1.data(), res.data(), x.data(), 0.2, kKey,
                                    &kCounters, S, B, C, 0);
    ops::dropout_backward<float>(cpu_exec(), d1.data(), x.data(), 0.2, kKey, &kCounters, S, B, C,
                                 0);
  }
  for (int threads : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << "threads=" << threads);
    ScopedOmpThreads scoped(threads);
    std::vector<float> y(n), a(n), d(n);
    ops::dropout_forward<float>(cpu_exec(), y.data(), x.data(), 0.2, kKey, &kCounters, S, B, C, 0);
    ops::dropout_add_forward<float>(cpu_exec(), a.data(), res.data(), x.data(), 0.2, kKey,
                                    &kCounters, S, B, C, 0);
    ops::dropout_backward<float>(cpu_exec(), d.data(), x.data(), 0.2, kKey, &kCounters, S, B, C, 0);
    EXPECT_TRUE(same_bits(y.data(), y1.data(), n));
    EXPECT_TRUE(same_bits(a.data(), a1.data(), n));
    EXPECT_TRUE(same_bits(d.data(), d1.data(), n));
  }
}

// p = 0 is the identity bitwise (x * 1), and needs no counters.
TEST(Dropout, ZeroIsTheIdentity) {
  const int64_t S = 7, B = 3, C = 70, n = S * B * C;
  auto x = random_vec<float>(n, 7, -1e30, 1e30);
  x[0] = -0.0f;
  x[1] = std::numeric_limits<float>::infinity();
  x[2] = std::numeric_limits<float>::denorm_min();
  const auto res = random_vec<float>(n, 8);
  std::vector<float> y(n), a(n), a_want(n), d(n);
  ops::dropout_forward<float>(cpu_exec(), y.data(), x.data(), 0.0, kKey, nullptr, S, B, C, 0);
  ops::dropout_add_forward<float>(cpu_exec(), a.data(), res.data(), x.data(), 0.0, kKey, nullptr, S,
                                  B, C, 0);
  ops::dropout_backward<float>(cpu_exec(), d.data(), x.data(), 0.0, kKey, nullptr, S, B, C, 0);
  for (int64_t i = 0; i < n; ++i) a_want[i] = res[i] + x[i];
  EXPECT_TRUE(same_bits(y.data(), x.data(), n));
  EXPECT_TRUE(same_bits(a.data(), a_want.data(), n));
  EXPECT_TRUE(same_bits(d.data(), x.data(), n));
}

// loss = sum(R * dropout_add(residual, x)): dL/dx = dropout_backward(R), dL/dresidual = R.
template <bool kFast>
void gradcheck() {
  SCOPED_TRACE(kFast ? "fast" : "ref");
  const int64_t S = 3, B = 2, C = 11, n = S * B * C;
  auto x = random_vec<double>(n, 11), res = random_vec<double>(n, 12);
  const auto R = random_vec<double>(n, 13);
  std::vector<double> y(n), dx(n);
  auto loss = [&] {
    if (kFast) {
      ops::cpu::dropout_add_forward(y.data(), res.data(), x.data(), 0.3, kKey, &kCounters, S, B, C,
                                    2);
    } else {
      ops::dropout_add_forward_ref(y.data(), res.data(), x.data(), 0.3, kKey, &kCounters, S, B, C,
                                   2);
    }
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += R[i] * y[i];
    return l;
  };
  if (kFast) {
    ops::cpu::dropout_backward(dx.data(), R.data(), 0.3, kKey, &kCounters, S, B, C, 2);
  } else {
    ops::dropout_backward_ref(dx.data(), R.data(), 0.3, kKey, &kCounters, S, B, C, 2);
  }
  EXPECT_TRUE(check_gradient(loss, x.data(), dx.data(), n, "dx", n));
  EXPECT_TRUE(check_gradient(loss, res.data(), R.data(), n, "dresidual", n));
  int64_t dropped = 0;
  for (double v : dx) dropped += v == 0.0;
  EXPECT_GT(dropped, 0);  // the check covers dropped elements too
}

TEST(Dropout, BackwardMatchesFiniteDifferences) {
  gradcheck<true>();
  gradcheck<false>();
}

TEST(Dropout, RejectsBadArguments) {
  std::vector<float> buf(8);
  for (double p : {-0.1, 1.0, 1.5, std::nan("")}) {
    EXPECT_NE(error_of([&] {
                ops::dropout_forward<float>(cpu_exec(), buf.data(), buf.data(), p, kKey, &kCounters,
                                            2, 2, 2, 0);
              }).find("outside [0, 1)"),
              std::string::npos)
        << p;
  }
  EXPECT_NE(error_of([&] {
              ops::dropout_backward<float>(cpu_exec(), buf.data(), buf.data(), 0.1, kKey, nullptr,
                                           2, 2, 2, 0);
            }).find("without counters"),
            std::string::npos);
  EXPECT_THROW(
      ops::dropout_forward_ref<float>(buf.data(), buf.data(), 0.1, kKey, &kCounters, 2, -2, 2, 0),
      Error);
}

}  // namespace
}  // namespace moecore::testing
