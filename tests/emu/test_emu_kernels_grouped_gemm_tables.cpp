// The device-table grouped GEMM's table kernel (src/ops/cuda/grouped_gemm_tables.cu) in the grid
// emulator, against grouped_gemm_tables_ref bitwise (every byte of every problem), in every
// resume order: empty experts first, last and in the middle, every group empty (zero tokens), one
// group, a warp's worth and one more, more groups than the block (the carried prefix: 256, 257,
// 600), negative counts (read as 0), counts that leave N, K or rows at 0 with null operands; the
// forward in both weight layouts, the dgrad (N, K exchanged) and the wgrad; f32, f64 and bf16
// element sizes. The table sits between guard bytes: nothing before or after it is written.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "emu/emu_testing.h"
#include "ops/grouped_gemm_tables.h"

namespace moecore {
namespace {

using emu_test::order_dependence;
using ops::GroupedGemmForm;
using ops::cuda::GroupedGemmProblem;
using ops::desc::GemmTypes;

constexpr size_t kP = sizeof(GroupedGemmProblem);
constexpr unsigned char kPoison = 0xA5;

struct Form {
  GroupedGemmForm form;
  bool trans_w;
};

void check_tables(const std::vector<int64_t>& m_G, int64_t N, int64_t K, Form f, GemmTypes types,
                  bool null_operands = false) {
  const int64_t G = int64_t(m_G.size());
  SCOPED_TRACE("G=" + std::to_string(G) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
               " form=" + std::to_string(int(f.form)) + " trans_w=" + std::to_string(f.trans_w) +
               " types=" + std::to_string(int(types)) + (null_operands ? " null operands" : ""));
  // The operands' addresses are only offset: any distinct bases do (never read).
  std::vector<unsigned char> a(64), b(64), d(64);
  const void* pa = null_operands ? nullptr : a.data();
  const void* pb = null_operands ? nullptr : b.data();
  void* pd = null_operands ? nullptr : d.data();
  std::vector<unsigned char> want(size_t(G) * kP);
  ops::grouped_gemm_tables_ref(reinterpret_cast<GroupedGemmProblem*>(want.data()), m_G.data(), G,
                               f.form, types, N, K, f.trans_w, pa, pb, pd);
  std::vector<unsigned char> got;
  const auto run = [&] {
    // One problem's worth of guard bytes on each side (8-byte aligned, as the struct needs).
    std::vector<GroupedGemmProblem> buf(size_t(G) + 2);
    std::memset(static_cast<void*>(buf.data()), kPoison, buf.size() * kP);
    ops::cuda::grouped_gemm_tables(nullptr, buf.data() + 1, m_G.data(), G, f.form, types, N, K,
                                   f.trans_w, pa, pb, pd);
    got.assign(reinterpret_cast<unsigned char*>(buf.data()),
               reinterpret_cast<unsigned char*>(buf.data() + buf.size()));
    return got;
  };
  EXPECT_EQ(order_dependence(run), "");
  for (size_t i = 0; i < kP; ++i) {
    ASSERT_EQ(got[i], kPoison) << "byte " << i << " before the table written";
    ASSERT_EQ(got[(size_t(G) + 1) * kP + i], kPoison) << "byte " << i << " after the table written";
  }
  for (int64_t g = 0; g < G; ++g) {
    ASSERT_EQ(std::memcmp(got.data() + size_t(g + 1) * kP, want.data() + size_t(g) * kP, kP), 0)
        << "problem " << g << " (" << m_G[size_t(g)] << " rows) differs from the reference";
  }
}

std::vector<int64_t> random_counts(int64_t G, uint32_t seed, double empty) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> rows(1, 40);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int64_t> m(static_cast<size_t>(G));
  for (auto& v : m) v = u(gen) < empty ? 0 : rows(gen);
  return m;
}

const Form kForms[] = {{GroupedGemmForm::Forward, false},
                       {GroupedGemmForm::Forward, true},
                       {GroupedGemmForm::Wgrad, false}};

TEST(EmuKernelsGroupedGemmTables, MatchTheReferenceInEveryOrder) {
  std::vector<std::vector<int64_t>> loads = {
      {5},          {0},          {0, 5, 0, 3}, {0, 0, 7},     {7, 0, 0},
      {0, 0, 0, 0}, {3, 1, 4, 1, 5, 9, 2, 6},   {2, -3, 4, -1, 0},  // negative: read as 0
  };
  for (int64_t G : {31, 32, 33, 64, 255, 256, 257, 600}) {
    loads.push_back(random_counts(G, uint32_t(G), 0.25));
  }
  loads.push_back(std::vector<int64_t>(300, 0));  // zero tokens over more than one chunk
  std::vector<int64_t> late(520, 0);              // the only rows in the last chunk
  late[517] = 11;
  loads.push_back(late);
  for (const auto& m : loads) {
    for (const Form& f : kForms) {
      for (GemmTypes types :
           {GemmTypes::F32, GemmTypes::F64, GemmTypes::Bf16F32, GemmTypes::Bf16Bf16}) {
        check_tables(m, 24, 40, f, types);
      }
    }
  }
}

// Degenerate dims: N or K at 0 (every problem computes nothing, or only beta D), with and
// without null operands (a call with nothing to read passes none).
TEST(EmuKernelsGroupedGemmTables, EmptyDimsAndNullOperands) {
  const std::vector<int64_t> m = {0, 3, 0, 2};
  for (const Form& f : kForms) {
    for (auto [N, K] : {std::pair<int64_t, int64_t>{0, 8}, {8, 0}, {0, 0}, {1, 1}}) {
      check_tables(m, N, K, f, GemmTypes::F32);
      check_tables(m, N, K, f, GemmTypes::F32, /*null_operands=*/true);
    }
  }
}

TEST(EmuKernelsGroupedGemmTables, NoGroupsLaunchNothing) {
  // G = 0: no launch, no access to the (null) table or counts.
  ops::cuda::grouped_gemm_tables(nullptr, nullptr, nullptr, 0, GroupedGemmForm::Forward,
                                 GemmTypes::F32, 8, 8, false, nullptr, nullptr, nullptr);
  EXPECT_THROW(ops::cuda::grouped_gemm_tables(nullptr, nullptr, nullptr, 2,
                                              GroupedGemmForm::Forward, GemmTypes::F32, 8, 8,
                                              false, nullptr, nullptr, nullptr),
               Error);
}

}  // namespace
}  // namespace moecore
