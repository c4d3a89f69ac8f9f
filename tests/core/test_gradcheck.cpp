// The finite-difference sampler of tests/common: covering_indices hits every row and every
// column of each matrix of a [G, R, C] tensor, the strided sampler it replaced for parameters
// does not, and a gradient wrong in one column only is caught.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"

namespace moecore::testing {
namespace {

TEST(CoveringIndices, HitsEveryRowAndColumnOfEveryGroup) {
  // R > C, R < C, R == C, coprime and not, a single row / column, several groups.
  const GroupedShape shapes[] = {{1, 16, 8}, {1, 8, 16}, {1, 6, 6}, {1, 7, 5}, {1, 1, 9},
                                 {1, 9, 1},  {4, 6, 8},  {3, 8, 3}, {1, 1, 1}, {2, 12, 18}};
  for (const GroupedShape& s : shapes) {
    for (int64_t per_group : {0, 5, 1000}) {
      SCOPED_TRACE(::testing::Message() << "[" << s.G << ", " << s.R << ", " << s.C
                                        << "] per_group " << per_group);
      auto idx = covering_indices(s, per_group, 42);
      EXPECT_TRUE(covers_every_row_and_column(idx, s));
      const int64_t expect = s.G * std::min(s.R * s.C, std::max({s.R, s.C, per_group}));
      EXPECT_EQ(static_cast<int64_t>(idx.size()), expect);
      EXPECT_EQ(idx, covering_indices(s, per_group, 42)) << "not deterministic in the seed";
    }
  }
  // Another seed, another permutation.
  EXPECT_NE(covering_indices({1, 16, 8}, 0, 1), covering_indices({1, 16, 8}, 0, 2));
}

TEST(CoveringIndices, ShapesFoldLeadingDimsIntoGroups) {
  GroupedShape v = grouped_shape({7});
  EXPECT_EQ(v.G * 100 + v.R * 10 + v.C, 117);
  GroupedShape m = grouped_shape({16, 8});
  EXPECT_EQ(m.G * 10000 + m.R * 100 + m.C, 11608);
  GroupedShape e = grouped_shape({2, 3, 6, 8});  // [2, 3] groups of 6 x 8
  EXPECT_EQ(e.G * 10000 + e.R * 100 + e.C, 60608);
}

// The checker itself can fail: the strided sampling check_gradient(n) uses misses columns of
// linear_qkv's [16, 8] weight (16 checks, stride 8: always column 4), and repeats are refused.
TEST(CoveringIndices, CheckerRejectsStridedSamplingAndRepeats) {
  const GroupedShape qkv{1, 16, 8};
  std::vector<int64_t> strided;
  for (int64_t i = 4; i < 128; i += 8) strided.push_back(i);
  auto r = covers_every_row_and_column(strided, qkv);
  EXPECT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("column"), std::string::npos) << r.message();
  auto idx = covering_indices(qkv, 0, 3);
  idx.push_back(idx.front());
  EXPECT_FALSE(covers_every_row_and_column(idx, qkv));
  EXPECT_FALSE(covers_every_row_and_column({128}, qkv));
}

// loss = sum_ij w_ij^2 / 2 has gradient w. A "backward" wrong in one column of a [16, 8]
// matrix fails the covering check whichever the column; the strided check at 16 points looks
// at column 4 only, so it passes seven of the eight bad gradients.
TEST(CoveringIndices, WrongGradientInOneColumnIsCaught) {
  const int64_t R = 16, C = 8;
  auto w = random_vec<double>(R * C, 5);
  auto loss = [&] {
    double s = 0;
    for (double v : w) s += 0.5 * v * v;
    return s;
  };
  for (int64_t bad_col = 0; bad_col < C; ++bad_col) {
    std::vector<double> g = w;
    for (int64_t r = 0; r < R; ++r) g[r * C + bad_col] += 0.1;
    EXPECT_FALSE(check_gradient(loss, w.data(), g.data(), {R, C}, "w", 16)) << bad_col;
    // The strided sampler at 16 checks sees column 4 only.
    EXPECT_EQ(static_cast<bool>(check_gradient(loss, w.data(), g.data(), R * C, "w", 16)),
              bad_col != 4)
        << bad_col;
  }
  EXPECT_TRUE(check_gradient(loss, w.data(), w.data(), {R, C}, "w", 16));
}

}  // namespace
}  // namespace moecore::testing
