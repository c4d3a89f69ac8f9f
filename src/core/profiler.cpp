#include "core/profiler.h"

#include <omp.h>

#include "core/check.h"
#include "core/device.h"

namespace moecore {

namespace {
thread_local PhaseProfiler* t_active = nullptr;
constexpr Phase kNone = Phase::Count;  // an interval outside every region: not counted

class HostPhaseTimer : public PhaseTimer {
 public:
  explicit HostPhaseTimer(int capacity) : t_(static_cast<size_t>(capacity)) {}
  int capacity() const override { return static_cast<int>(t_.size()); }
  void mark(int i) override { t_[i] = std::chrono::steady_clock::now(); }
  void move(int i, int j) override { t_[j] = t_[i]; }
  double seconds(int i, int j) override {
    return std::chrono::duration<double>(t_[j] - t_[i]).count();
  }

 private:
  std::vector<std::chrono::steady_clock::time_point> t_;
};
}  // namespace

std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::Gemm: return "gemm";
    case Phase::Attention: return "attention";
    case Phase::Router: return "router";
    case Phase::Permute: return "permute";
    case Phase::Communication: return "communication";
    case Phase::Optimizer: return "optimizer";
    case Phase::Data: return "data";
    case Phase::Other: return "other";
    case Phase::Count: break;
  }
  return "?";
}

std::unique_ptr<PhaseTimer> make_host_phase_timer(int capacity) {
  MOE_CHECK(capacity >= 2, "[profiler] {} marks: at least 2", capacity);
  return std::make_unique<HostPhaseTimer>(capacity);
}

std::unique_ptr<PhaseTimer> make_phase_timer(const Exec& ex, int capacity) {
  if (ex.on_cpu()) return make_host_phase_timer(capacity);
  return make_cuda_phase_timer(ex, capacity);
}

PhaseProfiler::PhaseProfiler(std::unique_ptr<PhaseTimer> timer)
    : timer_(timer ? std::move(timer) : make_host_phase_timer(kDefaultMarks)) {
  ended_.resize(static_cast<size_t>(timer_->capacity()));
  stack_.reserve(16);
}

void PhaseProfiler::mark(Phase ended) {
  if (marks_ == timer_->capacity()) resolve();  // keeps the last boundary as mark 0
  ended_[marks_] = ended;
  timer_->mark(marks_++);
}

void PhaseProfiler::push(Phase p) {
  // Outside every region (an empty stack) the time since the last mark is not counted.
  mark(stack_.empty() ? kNone : current_);
  stack_.push_back(current_);
  current_ = p;
}

void PhaseProfiler::pop() {
  mark(current_);
  current_ = stack_.back();
  stack_.pop_back();
}

void PhaseProfiler::reset() {
  seconds_.fill(0.0);
  marks_ = 0;
}

void PhaseProfiler::resolve() {
  for (int i = 1; i < marks_; ++i) {
    if (ended_[i] != kNone) seconds_[static_cast<int>(ended_[i])] += timer_->seconds(i - 1, i);
  }
  if (marks_ > 0 && !stack_.empty()) {  // the open region's time runs from its last boundary
    timer_->move(marks_ - 1, 0);
    ended_[0] = kNone;
    marks_ = 1;
  } else {
    marks_ = 0;
  }
}

double PhaseProfiler::seconds(Phase p) {
  resolve();
  return seconds_[static_cast<int>(p)];
}

double PhaseProfiler::total() {
  resolve();
  double t = 0;
  for (double s : seconds_) t += s;
  return t;
}

ActiveProfiler::ActiveProfiler(PhaseProfiler* p) : saved_(t_active) { t_active = p; }
ActiveProfiler::~ActiveProfiler() { t_active = saved_; }

ScopedPhase::ScopedPhase(Phase p) : prof_(t_active) {
  if (prof_ != nullptr && omp_in_parallel()) prof_ = nullptr;
  if (prof_ != nullptr) prof_->push(p);
}

ScopedPhase::~ScopedPhase() {
  if (prof_ != nullptr) prof_->pop();
}

}  // namespace moecore
