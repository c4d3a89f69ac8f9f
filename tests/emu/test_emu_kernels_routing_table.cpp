// Routing replay's table kernels (src/ops/cuda/routing_table.cu) in the grid emulator: store and
// load bitwise their `_ref` on the same inputs, as the CPU fast path's are (tests/ops/): runs
// inside the table, past its last position, with samples past its end or before its start,
// wholly outside, empty, K = 1, more ids than one block; a table of >= 2^31 ids (the 64-bit
// index form), read and written at its first rows and past 2^32 ids (where 32-bit indices would
// wrap onto the first rows), in a reserved mapping of which only the touched pages exist;
// guarded buffers, entries of other tokens kept, and bitwise the same in every resume order.
#include <gtest/gtest.h>
#include <sys/mman.h>

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
  int64_t samples, S, rows, B, K, pos0, sample0;
  int64_t allocated = -1;  // table ids held (-1: samples * S * K)
};

std::string name(const Case& c) {
  return "samples=" + std::to_string(c.samples) + " S=" + std::to_string(c.S) +
         " rows=" + std::to_string(c.rows) + " B=" + std::to_string(c.B) +
         " K=" + std::to_string(c.K) + " pos0=" + std::to_string(c.pos0) +
         " sample0=" + std::to_string(c.sample0);
}

const Case kCases[] = {
    {1, 1, 1, 1, 1, 0, 0},
    {4, 16, 16, 2, 2, 0, 0},
    {4, 16, 5, 3, 3, 7, 1},
    {4, 16, 5, 3, 3, 13, 2},  // positions past S, sample 4 past the table
    {3, 10, 4, 2, 1, 0, -1},  // sample -1
    {2, 6, 3, 2, 2, 0, 5},    // every sample outside
    {2, 8, 0, 2, 4, 0, 0},    // no rows
    {0, 4, 2, 2, 2, 0, 0},    // no samples
    {3, 9, 4, 2, 2, -2, 0},   // positions before 0
    {5, 300, 200, 4, 6, 50, 2},
    // samples * S * K = 2^32: the 64-bit form; sample0 0 and B 2 touch the first 2 S K ids.
    {int64_t(1) << 22, 256, 256, 2, 4, 0, 0, 2 * 256 * 4},
};

TEST(EmuKernelsRoutingTable, StoreIsTheReferenceBitwise) {
  uint32_t seed = 900;
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    const ops::DropoutCounters counters{1, c.sample0};
    const int64_t n_local = c.rows * c.B * c.K;
    const int64_t n_table = c.allocated >= 0 ? c.allocated : c.samples * c.S * c.K;
    const auto local = random_vec<int32_t>(n_local, seed++, 0, 1 << 20);
    const auto table0 = random_vec<int32_t>(n_table, seed++, 1 << 20, 1 << 21);
    std::vector<int32_t> want = table0;
    ops::routing_table_store_ref(want.data(), local.data(), &counters, c.samples, c.S, c.rows, c.B,
                                 c.K, c.pos0);
    Guarded<int32_t> got(n_table);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> t(n_table);
      std::copy(table0.begin(), table0.end(), t.data());
      ops::cuda::routing_table_store(nullptr, t.data(), local.data(), &counters, c.samples, c.S,
                                     c.rows, c.B, c.K, c.pos0);
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
    const ops::DropoutCounters counters{1, c.sample0};
    const int64_t n_local = c.rows * c.B * c.K;
    const int64_t n_table = c.allocated >= 0 ? c.allocated : c.samples * c.S * c.K;
    const auto table = random_vec<int32_t>(n_table, seed++, 0, 1 << 20);
    std::vector<int32_t> want(static_cast<size_t>(n_local));
    ops::routing_table_load_ref(want.data(), table.data(), &counters, c.samples, c.S, c.rows, c.B,
                                c.K, c.pos0);
    Guarded<int32_t> got(n_local);
    const std::string diff = order_dependence([&] {
      Guarded<int32_t> l(n_local, -7);
      ops::cuda::routing_table_load(nullptr, l.data(), table.data(), &counters, c.samples, c.S,
                                    c.rows, c.B, c.K, c.pos0);
      got = l;
      return bytes_of(l.data(), size_t(n_local));
    });
    EXPECT_EQ(diff, "");
    EXPECT_TRUE(got.intact()) << "written outside the run";
    EXPECT_TRUE(same_ids(got.data(), want.data(), n_local));
  }
}

// An anonymous mapping reserved without backing (MAP_NORESERVE): pages exist once touched, and an
// untouched page reads 0.
class Reserved {
 public:
  explicit Reserved(int64_t n) : bytes_(size_t(n) * sizeof(int32_t)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    p_ = p == MAP_FAILED ? nullptr : static_cast<int32_t*>(p);
  }
  ~Reserved() {
    if (p_) munmap(p_, bytes_);
  }
  Reserved(const Reserved&) = delete;
  Reserved& operator=(const Reserved&) = delete;
  int32_t* data() const { return p_; }

 private:
  size_t bytes_;
  int32_t* p_ = nullptr;
};

// samples * S * K = 2^32 + 2 S K ids (16 GiB of address space): of the run's samples 2^22 - 1
// .. 2^22 + 2, the first ends at id 2^32, the next two lie past it, the last outside. Store and
// load bitwise the references over the touched rows, and the first sample (where a 32-bit index
// would wrap to) kept.
TEST(EmuKernelsRoutingTable, TablesPast2To32IdsUse64BitIndices) {
  const int64_t S = 256, K = 4, B = 4, rows = S, samples = (int64_t(1) << 22) + 2;
  const int64_t n_table = samples * S * K, n_local = rows * B * K;
  const ops::DropoutCounters counters{1, samples - 3};
  const int64_t lo = (samples - 3) * S * K, window = n_table - lo;  // the rows the run may touch
  Reserved table(n_table), table_ref(n_table);
  if (!table.data() || !table_ref.data())
    GTEST_SKIP() << "not run: 16 GiB of address space refused";
  const auto local = random_vec<int32_t>(n_local, 990, 0, 1 << 20);
  const auto table0 = random_vec<int32_t>(window, 991, 1 << 20, 1 << 21);
  std::copy(table0.begin(), table0.end(), table_ref.data() + lo);
  ops::routing_table_store_ref(table_ref.data(), local.data(), &counters, samples, S, rows, B, K,
                               0);
  std::vector<int32_t> loaded_ref(static_cast<size_t>(n_local));
  ops::routing_table_load_ref(loaded_ref.data(), table_ref.data(), &counters, samples, S, rows, B,
                              K, 0);
  const std::vector<int32_t> zeros(static_cast<size_t>(S * K), 0);
  const std::string diff = order_dependence([&] {
    std::copy(table0.begin(), table0.end(), table.data() + lo);
    ops::cuda::routing_table_store(nullptr, table.data(), local.data(), &counters, samples, S, rows,
                                   B, K, 0);
    Guarded<int32_t> l(n_local, -7);
    ops::cuda::routing_table_load(nullptr, l.data(), table.data(), &counters, samples, S, rows, B,
                                  K, 0);
    EXPECT_TRUE(l.intact()) << "written outside the run";
    EXPECT_TRUE(same_ids(l.data(), loaded_ref.data(), n_local)) << "load";
    std::vector<unsigned char> out = bytes_of(table.data() + lo, size_t(window));
    const std::vector<unsigned char> b = bytes_of(l.data(), size_t(n_local));
    out.insert(out.end(), b.begin(), b.end());
    return out;
  });
  EXPECT_EQ(diff, "");
  EXPECT_TRUE(same_ids(table.data() + lo, table_ref.data() + lo, window)) << "store";
  EXPECT_TRUE(same_ids(table.data(), zeros.data(), S * K)) << "the first sample written";
}

TEST(EmuKernelsRoutingTable, BadArgumentsAreErrors) {
  const ops::DropoutCounters counters{};
  int32_t i = 0;
  EXPECT_THROW(ops::cuda::routing_table_store(nullptr, &i, &i, &counters, 1, 1, 1, 1, 0, 0), Error);
  EXPECT_THROW(ops::cuda::routing_table_load(nullptr, &i, &i, &counters, 1, -1, 1, 1, 1, 0), Error);
  EXPECT_THROW(ops::cuda::routing_table_load(nullptr, &i, &i, nullptr, 1, 1, 1, 1, 1, 0), Error);
}

}  // namespace
}  // namespace moecore
