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

// A member `rank` of a group of `size` whose backend does nothing: what the front end counts.
class CountingOnly final : public Communicator {
 public:
  CountingOnly(int size, int rank) : ranks_(size), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }

 protected:
  CommHandle start_all_reduce(void*, int64_t, DType, ReduceOp) override { return {}; }
  CommHandle start_all_gather_v(const void*, void*, std::span<const int64_t>, bool,
                                DType) override {
    return {};
  }
  CommHandle start_reduce_scatter_v(const void*, void*, std::span<const int64_t>, bool, DType,
                                    ReduceOp) override {
    return {};
  }
  CommHandle start_all_to_all_v(const void*, std::span<const int64_t>, void*,
                                std::span<const int64_t>, DType) override {
    return {};
  }
  CommHandle start_broadcast(void*, int64_t, DType, int) override { return {}; }
  CommHandle start_send(const void*, int64_t, DType, int, int) override { return {}; }
  CommHandle start_recv(void*, int64_t, DType, int, int) override { return {}; }
  CommHandle start_barrier() override { return {}; }

 private:
  std::string name_ = "tp";
  std::vector<int> ranks_;
  int rank_;
};

// The bytes each collective form sends, by the ring algorithm (CommBytesSent), hand-computed on a
// group of 4: equal pieces M (g-1)/g and 2 M (g-1)/g, uneven pieces by whose piece a member does
// not send, and nothing on one rank. Counted by the front end, so every backend reports these.
TEST(Communicator, BytesSentByCollectiveAreTheRingAlgorithms) {
  CountingOnly c(4, 1);
  std::vector<float> piece(6), whole(24);
  c.all_gather(piece, whole);  // M = 96 B: 72 B
  EXPECT_EQ(c.bytes_sent().all_gather, 72);
  c.reduce_scatter(whole, piece);  // 72 B
  EXPECT_EQ(c.bytes_sent().reduce_scatter, 72);
  std::vector<double> d(8);
  c.all_reduce(d);  // M = 64 B: 2 x 48 B
  EXPECT_EQ(c.bytes_sent().all_reduce, 96);
  c.all_reduce(d, ReduceOp::Max);  // a max moves as much as a sum
  EXPECT_EQ(c.bytes_sent().all_reduce, 192);
  // Uneven pieces {1, 2, 3, 4} f32 (40 B): member 1 forwards all but member 2's piece (12 B) in
  // the all-gather, and sends a partial sum of all but its own (8 B) in the reduce-scatter.
  const std::vector<int64_t> counts = {1, 2, 3, 4};
  std::vector<float> mine(2), all(10);
  c.all_gather_v(mine, all, counts);
  EXPECT_EQ(c.bytes_sent().all_gather, 72 + 28);
  c.reduce_scatter_v(all, mine, counts);
  EXPECT_EQ(c.bytes_sent().reduce_scatter, 72 + 32);
  // An all-reduce of 10 f32 cuts the ring into pieces of ceil(10 / 4) = 3, {3, 3, 3, 1} (the MPI
  // backend's ring): member 1 sends all but its own piece (7) in the reduce-scatter half and all
  // but member 2's (7) in the all-gather half; member 3, whose own piece is short, 9 + 7.
  std::vector<float> ten(10);
  c.all_reduce(ten);
  EXPECT_EQ(c.bytes_sent().all_reduce, 192 + 4 * (7 + 7));
  CountingOnly last(4, 3);
  last.all_reduce(ten);
  EXPECT_EQ(last.bytes_sent().all_reduce, 4 * (9 + 7));
  const std::vector<int64_t> a2a = {5, 7, 0, 1};
  std::vector<int32_t> s(13), r(13);
  c.all_to_all_v(s, a2a, r, a2a);  // all but its own block of 7
  EXPECT_EQ(c.bytes_sent().all_to_all, 4 * 6);
  EXPECT_EQ(c.all_to_all_bytes_sent(), 4 * 6);
  EXPECT_EQ(c.bytes_sent().total(), 72 + 28 + 72 + 32 + 192 + 56 + 24);
  const CommBytesSent before = c.bytes_sent();
  c.all_gather(piece, whole);
  EXPECT_EQ((c.bytes_sent() - before).all_gather, 72);
  EXPECT_EQ((c.bytes_sent() - before).total(), 72);
  // Broadcasts, point-to-point and barriers are not collectives of these forms.
  c.broadcast(piece, 0);
  c.barrier();
  EXPECT_EQ((c.bytes_sent() - before).total(), 72);

  auto one = make_local_communicator("tp", 0);
  std::vector<float> x(6);
  one->all_reduce(x);
  one->all_gather(x, x);
  one->reduce_scatter(x, x);
  EXPECT_EQ(one->bytes_sent().total(), 0);
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
