#include "core/profiler.h"

#include <omp.h>

namespace moecore {

namespace {
thread_local PhaseProfiler* t_active = nullptr;
}

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

void PhaseProfiler::push(Phase p) {
  auto now = Clock::now();
  if (!stack_.empty() || last_ != Clock::time_point{}) {
    seconds_[static_cast<int>(current_)] += std::chrono::duration<double>(now - last_).count();
  }
  stack_.push_back(current_);
  current_ = p;
  last_ = now;
}

void PhaseProfiler::pop() {
  auto now = Clock::now();
  seconds_[static_cast<int>(current_)] += std::chrono::duration<double>(now - last_).count();
  current_ = stack_.back();
  stack_.pop_back();
  last_ = stack_.empty() ? Clock::time_point{} : now;
}

double PhaseProfiler::total() const {
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
