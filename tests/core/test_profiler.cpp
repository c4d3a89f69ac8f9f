// The phase profiler: exclusive times from the marks of its timer, summed only when resolved
// (a device timer's events are read after the step), nested regions pausing their parent,
// time outside every region not counted, and a fixed number of marks reused when they run out.
#include <gtest/gtest.h>

#include <memory>

#include "core/profiler.h"

namespace moecore {
namespace {

// Boundary i happens at i seconds; the profile may read the marks only when it resolves.
struct FakeTimer : PhaseTimer {
  int cap;
  int reads = 0;
  explicit FakeTimer(int c) : cap(c) {}
  int capacity() const override { return cap; }
  void mark(int) override {}
  void move(int, int) override {}
  double seconds(int i, int j) override {
    ++reads;
    return j - i;
  }
};

TEST(PhaseProfiler, ExclusiveTimesFromMarksReadOnlyWhenResolved) {
  auto owned = std::make_unique<FakeTimer>(64);
  FakeTimer* timer = owned.get();
  PhaseProfiler prof(std::move(owned));
  ActiveProfiler active(&prof);
  {
    ScopedPhase step(Phase::Other);  // mark 0
    {
      ScopedPhase gemm(Phase::Gemm);  // mark 1: Other 1 s
      { ScopedPhase router(Phase::Router); }  // marks 2, 3: Gemm 1 s, Router 1 s
    }  // mark 4: Gemm 1 s
  }  // mark 5: Other 1 s
  { ScopedPhase data(Phase::Data); }  // marks 6, 7: the gap before 6 is outside every region
  EXPECT_EQ(timer->reads, 0) << "a device timer's events are read after the step, not during it";
  EXPECT_EQ(prof.seconds(Phase::Other), 2.0);
  EXPECT_EQ(prof.seconds(Phase::Gemm), 2.0);
  EXPECT_EQ(prof.seconds(Phase::Router), 1.0);
  EXPECT_EQ(prof.seconds(Phase::Data), 1.0);
  EXPECT_EQ(prof.total(), 6.0);
  prof.reset();
  EXPECT_EQ(prof.total(), 0.0);
}

// With more boundaries than marks the profile resolves what it has and goes on from the last
// boundary, open regions included: nothing is lost.
TEST(PhaseProfiler, PastItsMarksItResolvesAndGoesOn) {
  auto owned = std::make_unique<FakeTimer>(3);
  PhaseProfiler prof(std::move(owned));
  ActiveProfiler active(&prof);
  {
    ScopedPhase a(Phase::Gemm);           // boundary 0
    { ScopedPhase b(Phase::Router); }     // 1, 2: Gemm 1 s, Router 1 s
    { ScopedPhase c(Phase::Attention); }  // 3, 4: Gemm 1 s, Attention 1 s (marks reused)
    prof.resolve();                       // inside a: a goes on from boundary 4
  }                                       // 5: Gemm 1 s
  EXPECT_EQ(prof.seconds(Phase::Gemm), 3.0);
  EXPECT_EQ(prof.seconds(Phase::Router), 1.0);
  EXPECT_EQ(prof.seconds(Phase::Attention), 1.0);
  EXPECT_EQ(prof.total(), 5.0);
}

// The host timer: real, non-negative times; a region's time covers the work inside it.
TEST(PhaseProfiler, HostTimerMeasuresTheRegions) {
  PhaseProfiler prof;
  ActiveProfiler active(&prof);
  volatile double x = 0;
  {
    ScopedPhase gemm(Phase::Gemm);
    for (int i = 0; i < 100000; ++i) x = x + 1;
  }
  EXPECT_GT(prof.seconds(Phase::Gemm), 0.0);
  EXPECT_EQ(prof.seconds(Phase::Router), 0.0);
}

}  // namespace
}  // namespace moecore
