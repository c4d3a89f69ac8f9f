// The load-balanced context-parallel split: every position on exactly one rank, the inverse
// restores the sequence, and every rank gets the same causal work.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/check.h"
#include "parallel/context_split.h"

namespace moecore::parallel {
namespace {

TEST(ContextSplit, EveryPositionExactlyOnceAndTheInverse) {
  for (int cp : {1, 2, 3, 4, 8}) {
    const int64_t S = 2 * cp * 3, row = 2;
    std::vector<int> seen(S, 0);
    std::vector<double> x(S * row);
    std::iota(x.begin(), x.end(), 0.0);
    std::vector<std::vector<double>> parts(cp, std::vector<double>(S / cp * row));
    std::vector<const double*> ptrs;
    for (int r = 0; r < cp; ++r) {
      const ContextSplit s{S, cp, r};
      check_context_split(s);
      for (int64_t i = 0; i < s.local_length(); ++i) {
        const int64_t p = s.global_position(i);
        ++seen[p];
        EXPECT_EQ(s.owner(p), r);
        EXPECT_EQ(s.local_position(p), i);
      }
      context_split_rows(s, x.data(), row, parts[r].data());
      for (int64_t i = 0; i < s.local_length(); ++i)
        EXPECT_EQ(parts[r][i * row], static_cast<double>(s.global_position(i) * row));
      ptrs.push_back(parts[r].data());
    }
    for (int64_t p = 0; p < S; ++p) EXPECT_EQ(seen[p], 1) << "cp " << cp << " position " << p;
    std::vector<double> back(S * row, -1);
    context_unsplit_rows(S, cp, ptrs.data(), row, back.data());
    EXPECT_EQ(back, x) << "cp " << cp;
  }
}

// Causal work of a rank: sum over its queries of the keys they see (global position + 1). The
// balanced split gives every rank the same.
TEST(ContextSplit, CausalWorkIsBalanced) {
  for (int cp : {2, 4, 8}) {
    const int64_t S = 2 * cp * 5;
    int64_t first = -1;
    for (int r = 0; r < cp; ++r) {
      const ContextSplit s{S, cp, r};
      int64_t work = 0;
      for (int64_t i = 0; i < s.local_length(); ++i) work += s.global_position(i) + 1;
      if (first < 0) first = work;
      EXPECT_EQ(work, first) << "cp " << cp << " rank " << r;
    }
  }
}

TEST(ContextSplit, RefusesALengthThatDoesNotDivide) {
  try {
    check_context_split({/*S=*/10, /*cp=*/4, /*rank=*/0});
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--seq-length 10"), std::string::npos) << m;
    EXPECT_NE(m.find("--context-parallel-size"), std::string::npos) << m;
    EXPECT_NE(m.find("--seq-length 16"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(check_context_split({7, 1, 0}));
}

}  // namespace
}  // namespace moecore::parallel
