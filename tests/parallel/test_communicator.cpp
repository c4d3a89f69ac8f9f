// The communicator's shared argument checks and handles, on the one-rank local communicator
// (the multi-rank behaviour is tested under mpirun in tests/parallel/mpi/).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/check.h"
#include "core/sync_audit.h"
#include "parallel/communicator.h"
#include "parallel/communicator_nccl.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {
namespace {

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(LocalCommunicator, CollectivesOnOneRankAreCopies) {
  auto c = make_local_communicator("tp", 7);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->global_ranks(), std::vector<int>{7});
  std::vector<float> x = {1.5f, -2.f, 3.f};
  c->all_reduce(x);
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.f, 3.f}));
  std::vector<bf16> b = {float_to_bf16(1.f), float_to_bf16(259.f)};
  c->all_reduce(b, ReduceOp::Max);
  EXPECT_EQ(bf16_to_float(b[1]), bf16_to_float(float_to_bf16(259.f)));
  std::vector<int64_t> g(3);
  c->all_gather(std::vector<int64_t>{4, 5, 6}, g);
  EXPECT_EQ(g, (std::vector<int64_t>{4, 5, 6}));
  std::vector<int32_t> rs(2);
  const std::vector<int64_t> counts = {2};
  c->reduce_scatter_v(std::vector<int32_t>{8, 9}, rs, counts);
  EXPECT_EQ(rs, (std::vector<int32_t>{8, 9}));
  // In place: the one rank's slot is the whole send buffer.
  c->reduce_scatter_v(rs, std::span<int32_t>(rs), counts);
  EXPECT_EQ(rs, (std::vector<int32_t>{8, 9}));
  std::vector<double> a2a(0);
  const std::vector<int64_t> zero = {0};
  c->all_to_all_v(std::vector<double>{}, zero, a2a, zero);
  c->broadcast(x, 0);
  c->barrier();
  CommHandle h = c->all_reduce_async(x);
  EXPECT_TRUE(h.test());
  h.wait();
  EXPECT_TRUE(h.done());
}

// A build without CUDA has no NCCL communicator, and says how to get one (the CUDA build's one
// runs in tests/cuda/test_nccl.cpp where a GPU is visible).
TEST(NcclCommunicator, WithoutTheCudaBuildSaysHowToGetIt) {
  if (nccl_built()) GTEST_SKIP() << "the CUDA build: tests/cuda/test_nccl.cpp";
  auto boot = make_local_communicator("tp", 0);
  try {
    make_nccl_communicator(*boot, cpu_exec(), 60.0);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("group 'tp'"), std::string::npos) << m;
    EXPECT_NE(m.find("-DMOECORE_CUDA=ON"), std::string::npos) << m;
  }
}

TEST(Communicator, ArgumentChecksNameTheGroupAndSizes) {
  auto c = make_local_communicator("ep", 0);
  std::vector<float> small(2), big(5);
  expect_error([&] { c->all_gather(big, small); }, "all_gather on group 'ep'");
  const std::vector<int64_t> two = {1, 1};
  expect_error([&] { c->all_gather_v(small, small, two); }, "2 counts given for 1 ranks");
  const std::vector<int64_t> neg = {-1};
  expect_error([&] { c->all_reduce_async(big.data(), -1, DType::F32, ReduceOp::Sum); },
               "count -1 < 0");
  const std::vector<int64_t> three = {3};
  expect_error([&] { c->all_gather_v(small, small, three); }, "counts[0] = 3");
  expect_error([&] { c->all_to_all_v(small, three, small, three); },
               "all_to_all_v send on group 'ep'");
  expect_error([&] { c->all_to_all_v(small, neg, small, neg); }, "is -1 (< 0)");
  expect_error([&] { c->broadcast(small, 1); }, "root 1 outside [0, 1)");
  expect_error([&] { c->send(small, 3); }, "destination 3 outside [0, 1)");
  expect_error([&] { c->recv(small, -1); }, "source -1 outside [0, 1)");
}

#ifndef MOECORE_HAVE_MPI
// The stub build connects a world of one and refuses anything larger, saying why.
// A request the host completes (as MPI's): how many times it was waited for.
struct HostRequest : CommRequest {
  int* waits;
  explicit HostRequest(int* w) : waits(w) {}
  bool test() override { return false; }
  void wait() override { ++*waits; }
};
// A request a stream-ordered backend would make its stream wait for: no host wait.
struct StreamRequest : HostRequest {
  using HostRequest::HostRequest;
  bool wait_on(const Exec&) override { return false; }
};

// Inside an audited step: wait() (the host reads the result) is a host sync, a violation
// outside a documented point; wait_on (ops read it) completed on the host is counted as
// kHostCommWait; ordered on a stream it is nothing.
TEST(CommHandle, HostReadsAndStreamWaitsAreTold) {
  SyncAudit& audit = SyncAudit::instance();
  int waits = 0;
  audit.begin_step();
  CommHandle(CommRequestPtr(new HostRequest(&waits))).wait_on(cpu_exec());
  CommHandle(CommRequestPtr(new HostRequest(&waits))).wait_on(cpu_exec());
  CommHandle(CommRequestPtr(new StreamRequest(&waits))).wait_on(cpu_exec());
  {
    SyncAudit::Point point(SyncAudit::kEpCountExchange);
    CommHandle(CommRequestPtr(new HostRequest(&waits))).wait();  // part of the point
  }
  audit.end_step();
  EXPECT_EQ(waits, 3);
  EXPECT_EQ(audit.documented_syncs().at(SyncAudit::kHostCommWait), 2);
  EXPECT_EQ(audit.documented_syncs().at(SyncAudit::kEpCountExchange), 1);

  audit.begin_step();
  CommHandle(CommRequestPtr(new HostRequest(&waits))).wait();
  try {
    audit.end_step();
    ADD_FAILURE() << "a host read of a collective's result outside a documented point passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the host reads a collective's result"),
              std::string::npos)
        << e.what();
  }
}

TEST(StubBuild, OnlyOneProcessIsAvailable) {
  ProcessGroups one(make_layout(ParallelConfig{}, 1), 0);
  connect_communicators(one);
  std::vector<float> x = {2.f};
  one.dp().communicator().all_reduce(x);
  EXPECT_EQ(x[0], 2.f);
  ProcessGroups two(make_layout(ParallelConfig{}, 2), 0);
  expect_error([&] { connect_communicators(two); }, "unavailable");
  EXPECT_FALSE(mpi_available());
}
#endif

}  // namespace
}  // namespace moecore::parallel
