// gtest under mpirun: rank 0 prints gtest's usual output, the other ranks only their failures
// (with their rank), and the job fails when any rank failed.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"

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

// After RUN_ALL_TESTS, on every rank (the world size decides what skips, so all ranks agree):
// rank 0 names each skipped case with its reason, so a skip shows in ctest's output. A run that
// skipped every case prints "[mpi] world size W: every case skipped", which the ctest entry's
// SKIP_REGULAR_EXPRESSION (tests/CMakeLists.txt) reports as skipped. A run that skipped some of
// its cases but not all would be reported as passed: it fails instead, and says to register the
// skipping cases as their own ctest entry (a --gtest_filter).
inline int report_skips(int rc, int rank, int world_size) {
  const auto& unit = *::testing::UnitTest::GetInstance();
  std::vector<std::string> skipped;
  int ran = 0;
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const ::testing::TestInfo& info = *suite.GetTestInfo(j);
      if (!info.should_run()) continue;
      const ::testing::TestResult& r = *info.result();
      if (!r.Skipped()) {
        ++ran;
        continue;
      }
      std::string why;
      for (int k = 0; k < r.total_part_count(); ++k) {
        if (r.GetTestPartResult(k).skipped()) why += r.GetTestPartResult(k).message();
      }
      skipped.push_back(std::string(suite.name()) + "." + info.name() + " (" +
                        (why.empty() ? "no reason given" : why) + ")");
    }
  }
  if (skipped.empty()) return rc;
  if (rank == 0) {
    for (const auto& s : skipped) std::printf("[mpi] world size %d: skipped %s\n", world_size, s.c_str());
    if (ran == 0) {
      std::printf("[mpi] world size %d: every case skipped\n", world_size);
    } else {
      std::printf("[mpi] world size %d: %zu of %zu cases skipped while the others ran; ctest would "
                  "count this run as passed. Register the skipping cases as their own ctest entry "
                  "(--gtest_filter) in tests/CMakeLists.txt\n",
                  world_size, skipped.size(), skipped.size() + ran);
    }
    std::fflush(stdout);
  }
  return ran == 0 ? rc : std::max(rc, 1);
}

// The main() of an mpi gtest binary over the world's plain layout: gtest and the MPI runtime
// (into *rt) initialised, the world's groups connected with a one-minute timeout (a deadlocked
// test ends with a diagnostic, not a ctest timeout), all tests run, the job failed when any rank
// failed, skips reported. use_groups (if given) sees the groups before the tests and null after.
inline int run_mpi_tests(int argc, char** argv, parallel::Runtime* rt,
                         const std::function<void(parallel::ProcessGroups*)>& use_groups = {}) {
  ::testing::InitGoogleTest(&argc, argv);
  *rt = parallel::runtime_init(&argc, &argv);
  quiet_gtest_on_other_ranks(rt->rank);
  int rc = 0;
  {
    parallel::ParallelConfig cfg;
    cfg.timeout_minutes = 1.0;
    parallel::ProcessGroups groups(parallel::make_layout(cfg, rt->world_size), rt->rank);
    parallel::connect_communicators(groups);
    if (use_groups) use_groups(&groups);
    rc = RUN_ALL_TESTS();
    rc = any_rank_failed(rc, groups.world().communicator());
    rc = report_skips(rc, rt->rank, rt->world_size);
    if (use_groups) use_groups(nullptr);
  }
  parallel::runtime_finalize();
  return rc;
}

}  // namespace moecore::testing
