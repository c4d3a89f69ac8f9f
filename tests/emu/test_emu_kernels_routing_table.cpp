// Routing replay's table kernels (src/ops/cuda/routing_table.cu) in the grid emulator: store and
// load bitwise their `_ref` on the same inputs, as the CPU fast path's are (tests/ops/): runs
// inside the table, past its last position, before its first, wholly outside, empty, K = 1, more
// ids than one block; guarded buffers,
// entries of other tokens kept, and bitwise the same in every resume order.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/routing_table.h"

namespace moecore {
namespace {

using emu_test::bytes_of;
using emu_test::order_dependence;
using testing::Guarded;
using testing::random_vec;

// The first element where got and want differ, named.
::testing::AssertionResult same_ids(const int32_t* got, const int32_t* want, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (got[i] != want[i])
      return ::testing::AssertionFailure()
             << "element " << i << " of " << n << ": " << got[i] << " vs " << want[i];
  }
  return ::testing::AssertionSuccess();
}

struct Case {
  int64_t B, S, K, rows, pos0;
};

std::string name(const Case& c) {
  return "B=" + std::to_string(c.B) + " S=" + std::to_string(c.S) + " K=" + std::to_string(c.K) +
         " rows=" + std::to_string(c.rows) + " pos0=" + std::to_string(c.pos0);
}

const Case kCases[] = {
    {1, 1, 1, 1, 0},
    {2, 16, 2, 16, 0},
    {3, 16, 3, 5, 7},
    {3, 16, 3, 5, 13},  // positions past S
    {2, 10, 1, 4, 0},
    {2, 6, 2, 3, 9},    // every position outside
    {2, 8, 4, 0, 0},    // no rows
    {0, 4, 2, 2, 0},    // no samples
    {2, 9, 2, 4, -2},   // positions before 0
    {4, 300, 6, 200, 50},  // more ids than one block
};

TEST(EmuKernelsRoutingTable, StoreIsTheReferenceBitwise) {
  uint32_t seed = 900;
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    const int64_t n_local = c.rows * c.B * c.K, n_table = c.B * c.S * c.K;
    const auto local = random_vec<int32_t>(n_local, seed++, 0, 1 << 20);
    const auto table0 = random_vec<int32_t>(n_table, seed++, 1 << 20, 1 << 21);
    std::vector<int32_t> want = table0;
    ops::routing_table_store_ref(want.data(), local.data(), c.B, c.S, c.K, c.rows, c.pos0);
    Guarded<int32_t> got(n_table);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> t(n_table);
      std::copy(table0.begin(), table0.end(), t.data());
      ops::cuda::routing_table_store(nullptr, t.data(), local.data(), c.B, c.S, c.K, c.rows,
                                     c.pos0);
      got = t;
      return bytes_of(t.data(), size_t(n_table));
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(got.intact()) << "written outside the table";
    EXPECT_TRUE(same_ids(got.data(), want.data(), n_table));
  }
}

TEST(EmuKernelsRoutingTable, LoadIsTheReferenceBitwise) {
  uint32_t seed = 950;
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    const int64_t n_local = c.rows * c.B * c.K, n_table = c.B * c.S * c.K;
    const auto table = random_vec<int32_t>(n_table, seed++, 0, 1 << 20);
    std::vector<int32_t> want(static_cast<size_t>(n_local));
    ops::routing_table_load_ref(want.data(), table.data(), c.B, c.S, c.K, c.rows, c.pos0);
    Guarded<int32_t> got(n_local);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> l(n_local, -7);
      ops::cuda::routing_table_load(nullptr, l.data(), table.data(), c.B, c.S, c.K, c.rows,
                                    c.pos0);
      got = l;
      return bytes_of(l.data(), size_t(n_local));
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(got.intact()) << "written outside the run";
    EXPECT_TRUE(same_ids(got.data(), want.data(), n_local));
  }
}

TEST(EmuKernelsRoutingTable, BadArgumentsAreErrors) {
  int32_t i = 0;
  EXPECT_THROW(ops::cuda::routing_table_store(nullptr, &i, &i, 1, 1, 0, 1, 0), Error);
  EXPECT_THROW(ops::cuda::routing_table_load(nullptr, &i, &i, 1, -1, 1, 1, 0), Error);
  EXPECT_THROW(ops::cuda::routing_table_load(nullptr, &i, &i, 1 << 16, 1 << 13, 4, 1, 0), Error);
}

}  // namespace
}  // namespace moecore
