// The sync audit records what a captured step could not contain, with the call site: a heap
// allocation, an undocumented host sync; documented sync points are counted, and the host
// writing the step's inputs (Paused) is not an event.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "core/check.h"
#include "core/sync_audit.h"
#include "ops/memory.h"

namespace moecore {

// Not inlined, and not in an anonymous namespace (whose symbols are not exported): the audit
// must name it as the allocating call site.
[[gnu::noinline]] void allocate_inside_the_step(std::unique_ptr<int>* out) {
  *out = std::make_unique<int>(42);
}

namespace {

std::string end_step_error(SyncAudit& audit) {
  try {
    audit.end_step();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(SyncAudit, AnAllocationInsideAStepIsReportedWithItsCallSite) {
  SyncAudit& audit = SyncAudit::instance();
  std::unique_ptr<int> p;
  audit.begin_step();
  allocate_inside_the_step(&p);
  const std::string msg = end_step_error(audit);
  EXPECT_FALSE(audit.in_step());
  EXPECT_EQ(audit.allocations(), 1);
  EXPECT_NE(msg.find("allocation x1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("allocate_inside_the_step"), std::string::npos) << msg;
  // Outside a step, allocations are no events.
  allocate_inside_the_step(&p);
  EXPECT_EQ(audit.allocations(), 1);
}

TEST(SyncAudit, PausedAndDocumentedSyncsAreNoViolations) {
  SyncAudit& audit = SyncAudit::instance();
  std::unique_ptr<int> p;
  audit.begin_step();
  {
    SyncAudit::Paused inputs;
    allocate_inside_the_step(&p);  // the host preparing the step's inputs
  }
  audit.host_sync("test", SyncAudit::kEpCountExchange);
  audit.host_sync("test", SyncAudit::kEpCountExchange);
  EXPECT_EQ(end_step_error(audit), "");
  EXPECT_EQ(audit.allocations(), 0);
  ASSERT_EQ(audit.documented_syncs().count(SyncAudit::kEpCountExchange), 1u);
  EXPECT_EQ(audit.documented_syncs().at(SyncAudit::kEpCountExchange), 2);

  audit.begin_step();
  audit.host_sync("a read of the loss");  // not documented: a violation
  const std::string msg = end_step_error(audit);
  EXPECT_NE(msg.find("host sync: a read of the loss x1"), std::string::npos) << msg;
}

// A documented point counts once per scope and owns the host syncs inside it (its collective's
// wait, the host's read of the result); the innermost of nested points owns them; outside any
// point the same sync is a violation again.
TEST(SyncAudit, HostSyncsInsideAPointBelongToIt) {
  SyncAudit& audit = SyncAudit::instance();
  audit.begin_step();
  for (int layer = 0; layer < 2; ++layer) {
    SyncAudit::Point point(SyncAudit::kEpCountExchange);
    audit.host_sync("the count exchange's wait");
    audit.host_sync("the host reads the counts");
    {
      SyncAudit::Point inner(SyncAudit::kEpTokenCounts);
      audit.host_sync("inside the inner point");
    }
    audit.host_sync("back in the outer point");
  }
  EXPECT_EQ(end_step_error(audit), "");
  EXPECT_EQ(audit.documented_syncs().at(SyncAudit::kEpCountExchange), 2);
  EXPECT_EQ(audit.documented_syncs().at(SyncAudit::kEpTokenCounts), 2);

  audit.begin_step();
  { SyncAudit::Point point(SyncAudit::kEpCountExchange); }
  audit.host_sync("after the point");
  const std::string msg = end_step_error(audit);
  EXPECT_NE(msg.find("host sync: after the point x1"), std::string::npos) << msg;
}

// A layer's read of device data (ops::read_back, the router's and optimizer's host accessors)
// is a host sync the audit sees on every backend, the CPU's included: a violation inside a
// step, part of a documented point inside one, nothing outside a step.
TEST(SyncAudit, AReadBackIsAHostSync) {
  SyncAudit& audit = SyncAudit::instance();
  const double value = 2.5;
  EXPECT_EQ(ops::read_value<double>(cpu_exec(), &value), 2.5);  // no step: not recorded
  audit.begin_step();
  EXPECT_EQ(ops::read_value<double>(cpu_exec(), &value), 2.5);
  const std::string msg = end_step_error(audit);
  EXPECT_NE(msg.find("host sync: ops::read_back: the host reads device data x1"), std::string::npos)
      << msg;
  audit.begin_step();
  {
    SyncAudit::Point point(SyncAudit::kEpCountExchange);
    double got[1];
    ops::read_back<double>(cpu_exec(), got, &value, 1);
  }
  EXPECT_EQ(end_step_error(audit), "");
  EXPECT_EQ(audit.documented_syncs().at(SyncAudit::kEpCountExchange), 1);
}

TEST(SyncAudit, OneStepAtATime) {
  SyncAudit& audit = SyncAudit::instance();
  audit.begin_step();
  EXPECT_THROW(audit.begin_step(), Error);
  audit.end_step_quietly();
  EXPECT_FALSE(audit.in_step());
}

}  // namespace
}  // namespace moecore
