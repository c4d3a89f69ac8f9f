// Where a training step's time goes: exclusive time per phase (GEMM, attention, router,
// permutation, communication, optimizer, data loading, other). Code marks a region with
// ScopedPhase; a nested region pauses the enclosing one, so the phases add up to the step. Only the
// thread that installed the profiler records (regions inside OpenMP workers count for their
// caller), and with no profiler installed a ScopedPhase costs one thread-local load.
//
// The times are device-correct: each phase boundary is a mark of a PhaseTimer, and the
// intervals between marks are summed afterwards (resolve(), after the step's stream has run
// them). The CPU backend's ops have finished when they return, so its timer reads the host clock;
// a device backend's ops are only enqueued, so its timer records an event on the stream at each
// boundary (make_phase_timer). Marks are planned up front (a fixed capacity, nothing allocates):
// when they are all used the profile resolves the ones so far and goes on from the last (on a
// device that waits for the stream: a profiling cost only very long steps pay).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "core/exec.h"

namespace moecore {

enum class Phase : uint8_t {
  Gemm,
  Attention,
  Router,
  Permute,
  Communication,
  Optimizer,
  Data,
  Other,
  Count
};
inline constexpr int kNumPhases = static_cast<int>(Phase::Count);
std::string_view phase_name(Phase p);

// The clock of the phase boundaries: mark i records boundary i; seconds(i, j) is the time from
// boundary i to boundary j once the work before them has run; move(i, j) makes mark j what
// mark i was (the profile keeps its last boundary when it reuses the marks).
class PhaseTimer {
 public:
  virtual ~PhaseTimer() = default;
  virtual int capacity() const = 0;
  virtual void mark(int i) = 0;
  virtual double seconds(int i, int j) = 0;
  virtual void move(int i, int j) = 0;
};
// The host clock (the CPU backend).
std::unique_ptr<PhaseTimer> make_host_phase_timer(int capacity);
// The context's timer: the host clock on the CPU, stream events on a device (the CUDA build).
std::unique_ptr<PhaseTimer> make_phase_timer(const Exec& ex, int capacity);

class PhaseProfiler {
 public:
  static constexpr int kDefaultMarks = 1 << 16;
  // timer: null = the host clock with the default capacity.
  explicit PhaseProfiler(std::unique_ptr<PhaseTimer> timer = nullptr);

  void push(Phase p);
  void pop();
  // Drops the marks and the sums (the start of a step).
  void reset();
  // Sums the intervals marked since the last resolve (the device has run them: after the step's
  // stream synchronisation). An open region goes on from its last boundary.
  void resolve();
  // The phase's seconds, resolving first.
  double seconds(Phase p);
  double total();

 private:
  void mark(Phase ended);

  std::unique_ptr<PhaseTimer> timer_;
  std::array<double, kNumPhases> seconds_{};
  std::vector<Phase> stack_;
  std::vector<Phase> ended_;  // the phase of the interval ending at each mark (Count: none)
  Phase current_ = Phase::Other;
  int marks_ = 0;
};

// Installs `p` as this thread's profiler for the guard's lifetime (nullptr: none).
class ActiveProfiler {
 public:
  explicit ActiveProfiler(PhaseProfiler* p);
  ~ActiveProfiler();
  ActiveProfiler(const ActiveProfiler&) = delete;
  ActiveProfiler& operator=(const ActiveProfiler&) = delete;

 private:
  PhaseProfiler* saved_;
};

class ScopedPhase {
 public:
  explicit ScopedPhase(Phase p);
  ~ScopedPhase();
  ScopedPhase(const ScopedPhase&) = delete;
  ScopedPhase& operator=(const ScopedPhase&) = delete;

 private:
  PhaseProfiler* prof_;
};

}  // namespace moecore
