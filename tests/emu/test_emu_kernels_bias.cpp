// The column-bias kernels (src/ops/cuda/bias.cu) in the grid emulator: the forward bitwise
// bias_forward_ref (one addition per element), the backward within the dtype's tolerance of
// bias_backward_ref (f64 sums there) and bitwise reduce_cols.cuh's association of the sums
// (col_reduce_model.h: splits, warps, rows; no multiply to contract) whether dy is 16-byte aligned
// (vector loads) or not, accumulated onto nonzero db, guarded buffers, in every resume order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

// Checks in every resume order, or in the default one alone (`orders` false: large sizes). dy
// starts `off` elements past a 16-byte boundary.
template <typename T>
void check_bias(int64_t M, int64_t N, bool orders = true, int64_t off = 0) {
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " dy offset " +
               std::to_string(off));
  const std::vector<T> y0 = random_vec<T>(M * N, 51), b = random_vec<T>(N, 52);
  const std::vector<T> dy_padded = random_vec<T>(off + M * N, 53), db0 = random_vec<T>(N, 54);
  const T* dy_ptr = dy_padded.data() + off;
  const std::vector<T> dy(dy_ptr, dy_ptr + M * N);
  std::vector<T> y_ref = y0, db_ref = db0, db_seq = db0;
  ops::bias_forward_ref(y_ref.data(), b.data(), M, N);
  ops::bias_backward_ref(db_ref.data(), dy.data(), M, N);
  const ops::cuda::ColReducePlan plan = ops::cuda::plan_col_reduce<T>(M, N, 1, "test");
  for (int64_t n = 0; n < N; ++n) {  // reduce_cols.cuh's association, in T
    db_seq[size_t(n)] += emu_test::col_tree_sum<T>(
        plan, M, [&](T& acc, int64_t m) { acc += dy[size_t(m * N + n)]; });
  }

  Guarded<T> y(M * N), db(N);
  const auto run = [&] {
    Guarded<T> y1(M * N), db1(N);
    for (int64_t i = 0; i < M * N; ++i) y1[i] = y0[size_t(i)];
    for (int64_t n = 0; n < N; ++n) db1[n] = db0[size_t(n)];
    ops::cuda::bias_forward(nullptr, y1.data(), b.data(), M, N);
    ops::cuda::bias_backward(nullptr, db1.data(), dy_ptr, M, N);
    y = y1;
    db = db1;
    std::vector<unsigned char> out = bytes_of(y1.data(), size_t(M * N));
    const std::vector<unsigned char> d = bytes_of(db1.data(), size_t(N));
    out.insert(out.end(), d.begin(), d.end());
    return out;
  };
  if (orders)
    EXPECT_EQ(order_dependence(run), "");
  else
    run();
  EXPECT_TRUE(y.intact()) << "y written outside its elements";
  EXPECT_TRUE(db.intact()) << "db written outside its elements";
  for (int64_t i = 0; i < M * N; ++i) {
    ASSERT_EQ(std::memcmp(&y[i], &y_ref[size_t(i)], sizeof(T)), 0) << "y element " << i;
  }
  for (int64_t n = 0; n < N; ++n) {
    ASSERT_NEAR(db[n], db_ref[size_t(n)], kAtol<T> + kRtol<T> * std::abs(db_ref[size_t(n)]))
        << "db element " << n;
    ASSERT_EQ(std::memcmp(&db[n], &db_seq[size_t(n)], sizeof(T)), 0)
        << "db element " << n << " differs from reduce_cols' association of the rows";
  }
}

// One element; a row and a column; widths around the block (256) and not a multiple of the warp;
// tall matrices (long column sums); no rows or no columns (no launch, db unchanged); past the
// forward's grid-stride cap (in one order).
TEST(EmuKernelsBias, ForwardAndBackwardMatchTheReferenceInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},   {1, 300}, {300, 1},  {7, 33},
                                                           {5, 255}, {3, 257}, {129, 31}, {2, 1000},
                                                           {0, 5},   {5, 0}};
  for (auto [M, N] : shapes) {
    check_bias<float>(M, N);
    check_bias<double>(M, N);
  }
  check_bias<float>(300, 1000, /*orders=*/false);  // 300k elements: > 270336 threads
}

// The backward's two stages with several blocks in each: column tiles (128 f32 / 64 f64 columns
// of vector loads, 32 of scalar ones), row splits (at least 64 rows each, the last one short),
// more than 8 splits (stage 2's warps add several); N a multiple of the vector width or not, dy
// aligned or one element off (scalar loads, the same association: the same bits as the model).
TEST(EmuKernelsBias, BackwardInSeveralBlocksOfBothStagesInEveryOrder) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {600, 130}, {530, 132}, {640, 3}, {1100, 8}, {129, 68}};
  for (auto [M, N] : shapes) {
    for (int64_t off : {0, 1}) {
      check_bias<float>(M, N, true, off);
      check_bias<double>(M, N, true, off);
    }
  }
  const ops::cuda::ColReducePlan p = ops::cuda::plan_col_reduce<float>(600, 130, 1, "test");
  EXPECT_EQ(p.splits, 10);  // the shape above does take both stages, stage 2 with > 8 partials
  EXPECT_EQ(p.rows_per_split, 64);
}

TEST(EmuKernelsBias, NegativeShapesAreErrors) {
  float v = 0;
  EXPECT_THROW(ops::cuda::bias_forward<float>(nullptr, &v, &v, -1, 2), Error);
  EXPECT_THROW(ops::cuda::bias_forward<float>(nullptr, &v, &v, 2, -1), Error);
  EXPECT_THROW(ops::cuda::bias_backward<float>(nullptr, &v, &v, -1, 2), Error);
  EXPECT_THROW(ops::cuda::bias_backward<float>(nullptr, &v, &v, 2, -1), Error);
}

}  // namespace
}  // namespace moecore
