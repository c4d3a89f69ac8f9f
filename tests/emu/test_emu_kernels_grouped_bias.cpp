// The grouped-bias kernels (src/ops/cuda/grouped_bias.cu) in the grid emulator, against
// grouped_bias_forward_ref / grouped_bias_backward_ref within the dtype's tolerance: empty groups
// first, last and in the middle, one group, widths around the block and not a multiple of the
// warp, groups longer than the grid-stride loop's grid, with and without the routing prob, onto
// nonzero db and dp, rows past the last group left alone, guarded buffers, every resume order;
// db bitwise reduce_cols.cuh's association of each group's rows (one split per group:
// col_reduce_model.h), dy aligned or one element off.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "common/testing.h"
#include "common/tolerances.h"
#include "core/check.h"
#include "emu/col_reduce_model.h"
#include "emu/emu_testing.h"
#include "ops/bias.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::kAtol;
using emu_test::kRtol;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

template <typename T>
void expect_near_all(const Guarded<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_TRUE(got.intact()) << what << " written outside its elements";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[int64_t(i)], want[i], kAtol<T> + kRtol<T> * std::abs(want[i]))
        << what << " element " << i;
  }
}

// `extra` rows past the last group: the kernels must not touch them. dy starts `off` elements
// past a 16-byte boundary.
template <typename T>
void check_grouped_bias(const std::vector<int64_t>& m_G, int64_t C, bool with_p, int64_t extra,
                        int64_t off = 0) {
  const int64_t G = int64_t(m_G.size());
  const int64_t rows = std::accumulate(m_G.begin(), m_G.end(), int64_t{0}) + extra;
  SCOPED_TRACE("G=" + std::to_string(G) + " rows=" + std::to_string(rows) +
               " C=" + std::to_string(C) + " p=" + std::to_string(with_p) + " dy offset " +
               std::to_string(off));
  const std::vector<T> y0 = random_vec<T>(rows * C, 61), b = random_vec<T>(G * C, 62);
  const std::vector<T> dy_padded = random_vec<T>(off + rows * C, 63),
                       db0 = random_vec<T>(G * C, 64);
  const T* dy_ptr = dy_padded.data() + off;
  const std::vector<T> dy(dy_ptr, dy_ptr + rows * C);
  const std::vector<T> p = random_vec<T>(rows, 65), dp0 = random_vec<T>(rows, 66);
  const T* p_ptr = with_p ? p.data() : nullptr;
  std::vector<T> y_ref = y0, db_ref = db0, dp_ref = dp0;
  ops::grouped_bias_forward_ref(y_ref.data(), b.data(), p_ptr, m_G.data(), G, C);
  ops::grouped_bias_backward_ref(db_ref.data(), with_p ? dp_ref.data() : nullptr, dy.data(),
                                 b.data(), p_ptr, m_G.data(), G, C);

  Guarded<T> y(rows * C), db(G * C), dp(rows);
  const auto run = [&] {
    Guarded<T> y1(rows * C), db1(G * C), dp1(rows);
    std::copy(y0.begin(), y0.end(), y1.data());
    std::copy(db0.begin(), db0.end(), db1.data());
    std::copy(dp0.begin(), dp0.end(), dp1.data());
    ops::cuda::grouped_bias_forward(nullptr, y1.data(), b.data(), p_ptr, m_G.data(), G, C);
    ops::cuda::grouped_bias_backward(nullptr, db1.data(), with_p ? dp1.data() : nullptr, dy_ptr,
                                     b.data(), p_ptr, m_G.data(), G, C);
    y = y1;
    db = db1;
    dp = dp1;
    std::vector<unsigned char> out = bytes_of(y1.data(), size_t(rows * C));
    for (const auto& part :
         {bytes_of(db1.data(), size_t(G * C)), bytes_of(dp1.data(), size_t(rows))})
      out.insert(out.end(), part.begin(), part.end());
    return out;
  };
  EXPECT_EQ(order_dependence(run), "");
  expect_near_all(y, y_ref, "y");
  expect_near_all(db, db_ref, "db");
  expect_near_all(dp, dp_ref, "dp");
  ops::cuda::ColReducePlan plan;  // grouped_bias.cu's: one split per group
  plan.M = 1;
  plan.N = int(C);
  plan.rows_per_split = 0x7ffffff8;
  int64_t row0 = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < C; ++c) {
      const T tree = emu_test::col_tree_sum<T>(plan, m_G[size_t(g)], [&](T& acc, int64_t m) {
        const size_t i = size_t((row0 + m) * C + c);
        if (with_p)
          acc += p[size_t(row0 + m)] * dy[i];
        else
          acc += dy[i];
      });
      const T want = db0[size_t(g * C + c)] + tree;
      ASSERT_EQ(std::memcmp(&db[g * C + c], &want, sizeof(T)), 0)
          << "db group " << g << " column " << c << ": " << db[g * C + c]
          << " is not reduce_cols' association " << want;
    }
    row0 += m_G[size_t(g)];
  }
}

TEST(EmuKernelsGroupedBias, MatchTheReferenceInEveryOrder) {
  struct Shape {
    std::vector<int64_t> m_G;
    int64_t C;
  };
  const std::vector<Shape> shapes = {
      {{1}, 1},         {{3}, 33}, {{0, 5, 0}, 7}, {{0, 0, 4}, 129},  {{2, 0, 3, 1}, 31},
      {{5, 4, 0}, 257}, {{0}, 5},  {{3, 3}, 0},    {{1, 200, 2}, 40},  // 8000 elements in the
                                                                       // middle group: past the 32
                                                                       // x 128 grid-stride
  };
  for (const Shape& s : shapes) {
    for (bool with_p : {false, true}) {
      check_grouped_bias<float>(s.m_G, s.C, with_p, 0);
      check_grouped_bias<double>(s.m_G, s.C, with_p, 3);
    }
  }
  check_grouped_bias<float>({}, 9, true, 2);  // no groups: nothing changes
}

// db in several column tiles per group (128 f32 / 64 f64 columns with vector loads, 32 without),
// groups longer than the 8 warps' rows, C a multiple of the vector width or not, dy aligned or one
// element off (scalar loads, the same association).
TEST(EmuKernelsGroupedBias, DbInSeveralColumnTilesPerGroupInEveryOrder) {
  for (int64_t off : {0, 1}) {
    for (bool with_p : {false, true}) {
      check_grouped_bias<float>({70, 0, 33}, 260, with_p, 1, off);
      check_grouped_bias<double>({9, 41}, 130, with_p, 0, off);
      check_grouped_bias<float>({17, 5}, 35, with_p, 0, off);
    }
  }
}

TEST(EmuKernelsGroupedBias, BadArgumentsAreErrors) {
  float v = 0;
  const int64_t m = 1;
  EXPECT_THROW(ops::cuda::grouped_bias_forward<float>(nullptr, &v, &v, nullptr, &m, -1, 2), Error);
  EXPECT_THROW(ops::cuda::grouped_bias_forward<float>(nullptr, &v, &v, nullptr, &m, 1, -2), Error);
  EXPECT_THROW(ops::cuda::grouped_bias_forward<float>(nullptr, &v, &v, nullptr, nullptr, 1, 2),
               Error);
  EXPECT_THROW(ops::cuda::grouped_bias_backward<float>(nullptr, &v, &v, &v, &v, &v, &m, 70000, 2),
               Error);
}

}  // namespace
}  // namespace moecore
