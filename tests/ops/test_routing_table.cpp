// Routing replay's table copies: a hand example of both formulas; the fast path bitwise the
// reference on random ids for runs inside the table, past its last position, before its first,
// wholly outside, empty, K = 1, and above the OpenMP threshold (on two threads); entries of other
// tokens untouched; store then load returns the run where it lies in the table (-1 elsewhere); a
// one-rank table read back by a two-rank sequence split; the shape checks.
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "ops/routing_table.h"

namespace moecore::testing {
namespace {

struct Case {
  int64_t B, S, K, rows, pos0;
};
const Case kCases[] = {{1, 1, 1, 1, 0},  {2, 16, 2, 16, 0}, {3, 16, 3, 5, 7},   {3, 16, 3, 5, 13},
                       {2, 10, 1, 4, 0}, {2, 6, 2, 3, 9},   {2, 8, 4, 0, 0},    {0, 4, 2, 2, 0},
                       {2, 9, 2, 4, -2}, {4, 512, 8, 512, 0}};

std::string name(const Case& c) {
  return "B=" + std::to_string(c.B) + " S=" + std::to_string(c.S) + " K=" + std::to_string(c.K) +
         " rows=" + std::to_string(c.rows) + " pos0=" + std::to_string(c.pos0);
}

// Runs f and expects a moecore::Error whose message contains `part`.
template <typename F>
void expect_error(F f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}
#define EXPECT_THROW_MSG(stmt, part) expect_error([&] { stmt; }, part)

bool inside(const Case& c, int64_t s) { return c.pos0 + s >= 0 && c.pos0 + s < c.S; }

// table [B = 2, S = 3, K = 2]; a run of rows = 3 from position 1 (positions 1, 2, and 3 outside).
TEST(RoutingTable, HandExample) {
  // (s, b) = 00 01 10 11 20 21
  const std::vector<int32_t> local = {10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61};
  const std::vector<int32_t> table(12, 99);
  for (bool ref : {false, true}) {
    std::vector<int32_t> t = table;
    if (ref)
      ops::routing_table_store_ref(t.data(), local.data(), 2, 3, 2, 3, 1);
    else
      ops::routing_table_store(cpu_exec(), t.data(), local.data(), 2, 3, 2, 3, 1);
    // Sample 0: positions 1, 2 = 10 11, 30 31; sample 1: 20 21, 40 41.
    EXPECT_EQ(t, (std::vector<int32_t>{99, 99, 10, 11, 30, 31, 99, 99, 20, 21, 40, 41}));
    Guarded<int32_t> back(12, -7);
    if (ref)
      ops::routing_table_load_ref(back.data(), t.data(), 2, 3, 2, 3, 1);
    else
      ops::routing_table_load(cpu_exec(), back.data(), t.data(), 2, 3, 2, 3, 1);
    EXPECT_EQ(back.vec(),
              (std::vector<int32_t>{10, 11, 20, 21, 30, 31, 40, 41, -1, -1, -1, -1}));
    EXPECT_TRUE(back.intact());
  }
}

TEST(RoutingTable, FastMatchesRefAndRoundTrips) {
  ScopedOmpThreads threads(2);
  uint32_t seed = 40;
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    const int64_t n_local = c.rows * c.B * c.K, n_table = c.B * c.S * c.K;
    // Ids of the run in [0, 2^20), the table's other values above: a copy from the wrong place
    // or an entry left unwritten shows.
    const auto local = random_vec<int32_t>(n_local, seed++, 0, 1 << 20);
    const auto table0 = random_vec<int32_t>(n_table, seed++, 1 << 20, 1 << 21);
    Guarded<int32_t> table(n_table), table_r(n_table), loaded(n_local, -7), loaded_r(n_local, -7);
    std::copy(table0.begin(), table0.end(), table.data());
    std::copy(table0.begin(), table0.end(), table_r.data());
    ops::routing_table_store(cpu_exec(), table.data(), local.data(), c.B, c.S, c.K, c.rows, c.pos0);
    ops::routing_table_store_ref(table_r.data(), local.data(), c.B, c.S, c.K, c.rows, c.pos0);
    EXPECT_EQ(table.vec(), table_r.vec());
    EXPECT_TRUE(table.intact() && table_r.intact());
    // Entries no token of the run maps to keep their values.
    std::vector<char> hit(static_cast<size_t>(n_table), 0);
    for (int64_t s = 0; s < c.rows; ++s) {
      if (!inside(c, s)) continue;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t k = 0; k < c.K; ++k)
          hit[static_cast<size_t>((b * c.S + c.pos0 + s) * c.K + k)] = 1;
    }
    int64_t overwritten = 0;
    for (int64_t i = 0; i < n_table; ++i)
      overwritten += !hit[static_cast<size_t>(i)] && table[i] != table0[static_cast<size_t>(i)];
    EXPECT_EQ(overwritten, 0) << "table entries of no token of the run written";
    // Store then load: the run's ids where its token lies in the table, -1 elsewhere.
    ops::routing_table_load(cpu_exec(), loaded.data(), table.data(), c.B, c.S, c.K, c.rows, c.pos0);
    ops::routing_table_load_ref(loaded_r.data(), table.data(), c.B, c.S, c.K, c.rows, c.pos0);
    EXPECT_EQ(loaded.vec(), loaded_r.vec());
    EXPECT_TRUE(loaded.intact() && loaded_r.intact());
    int64_t wrong = 0;
    for (int64_t s = 0; s < c.rows; ++s) {
      for (int64_t b = 0; b < c.B; ++b) {
        for (int64_t k = 0; k < c.K; ++k) {
          const int64_t i = (s * c.B + b) * c.K + k;
          wrong += loaded[i] != (inside(c, s) ? local[static_cast<size_t>(i)] : -1);
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "ids of the run not read back (-1 outside the table)";
    // The load's own fast == reference on the untouched table (its other values).
    Guarded<int32_t> l0(n_local, -7), l0_r(n_local, -7);
    ops::routing_table_load(cpu_exec(), l0.data(), table0.data(), c.B, c.S, c.K, c.rows, c.pos0);
    ops::routing_table_load_ref(l0_r.data(), table0.data(), c.B, c.S, c.K, c.rows, c.pos0);
    EXPECT_EQ(l0.vec(), l0_r.vec());
  }
}

// Layout independence: a one-rank run records its [S, B] tokens; a two-way sequence split (rows
// S / 2 from pos0 0 and S / 2, as TP's sequence slices) and the load-balanced CP split's two
// chunks of each half each read back exactly their rows of the one-rank buffer.
TEST(RoutingTable, SplitLayoutsReadTheOneRankRows) {
  const int64_t S = 8, B = 2, K = 3;
  const auto local = random_vec<int32_t>(S * B * K, 3, 0, 64);
  std::vector<int32_t> table(B * S * K, -5);
  ops::routing_table_store(cpu_exec(), table.data(), local.data(), B, S, K, S, 0);
  for (int64_t half : {0, 1}) {  // sequence split: rows [half S / 2, (half + 1) S / 2)
    std::vector<int32_t> got(S / 2 * B * K);
    ops::routing_table_load(cpu_exec(), got.data(), table.data(), B, S, K, S / 2, half * S / 2);
    const std::vector<int32_t> want(local.begin() + half * (S / 2) * B * K,
                                    local.begin() + (half + 1) * (S / 2) * B * K);
    EXPECT_EQ(got, want) << "sequence half " << half;
  }
  // CP 2 rank 0: chunks 0 and 3 of 4 (positions 0-1, 6-7), one call per run.
  std::vector<int32_t> got(4 * B * K);
  ops::routing_table_load(cpu_exec(), got.data(), table.data(), B, S, K, 2, 0);
  ops::routing_table_load(cpu_exec(), got.data() + 2 * B * K, table.data(), B, S, K, 2, 6);
  std::vector<int32_t> want(local.begin(), local.begin() + 2 * B * K);
  want.insert(want.end(), local.begin() + 6 * B * K, local.end());
  EXPECT_EQ(got, want) << "context-parallel chunks";
}

TEST(RoutingTable, BadShapesThrowNamingThem) {
  int32_t x = 0;
  EXPECT_THROW_MSG(ops::routing_table_store(cpu_exec(), &x, &x, 1, 1, 0, 1, 0), "K=0");
  EXPECT_THROW_MSG(ops::routing_table_load(cpu_exec(), &x, &x, 1, -1, 1, 1, 0), "S=-1");
  EXPECT_THROW_MSG(ops::routing_table_store_ref(&x, &x, 1, 1, 1, -1, 0), "rows=-1");
  EXPECT_THROW_MSG(ops::routing_table_load(cpu_exec(), &x, &x, 1 << 16, 1 << 13, 4, 1, 0),
                   "2^31 ids");
}

}  // namespace
}  // namespace moecore::testing
