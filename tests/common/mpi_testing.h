// gtest under mpirun: rank 0 prints gtest's usual output, the other ranks only their failures
// (with their rank), and the job fails when any rank failed.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "parallel/communicator.h"

namespace moecore::testing {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "", r.line_number(), r.summary());
  }

 private:
  int rank_;
};

// Call after InitGoogleTest on every rank.
inline void quiet_gtest_on_other_ranks(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}

// The largest return code over `world`: every rank exits non-zero if any rank failed.
inline int any_rank_failed(int rc, parallel::Communicator& world) {
  std::vector<int32_t> any = {rc};
  world.all_reduce(any, parallel::ReduceOp::Max);
  return any[0];
}

}  // namespace moecore::testing
