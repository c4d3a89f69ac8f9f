// Where a training step's time goes: exclusive wall time per phase (GEMM, attention, router,
// permutation, communication, optimizer, data loading, other). Code marks a region with
// ScopedPhase; a nested region pauses the enclosing one, so the phases add up to the step. Only the
// thread that installed the profiler records (regions inside OpenMP workers count for their
// caller), and with no profiler installed a ScopedPhase costs one thread-local load.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string_view>
#include <vector>

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

class PhaseProfiler {
 public:
  using Clock = std::chrono::steady_clock;

  void push(Phase p);
  void pop();
  void reset() { seconds_.fill(0.0); }
  double seconds(Phase p) const { return seconds_[static_cast<int>(p)]; }
  double total() const;

 private:
  std::array<double, kNumPhases> seconds_{};
  std::vector<Phase> stack_;
  Phase current_ = Phase::Other;
  Clock::time_point last_{};
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
