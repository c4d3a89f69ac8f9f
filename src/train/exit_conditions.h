// When a run stops before --train-iters: --exit-interval (after every multiple of it),
// --exit-duration-in-mins (once the run has taken that long) and --exit-signal-handler (SIGTERM
// or SIGINT: the step in flight finishes first). The trainer then saves a checkpoint (with
// --save) and returns; `moecore train` exits with status 0. The ranks agree on every stop: a
// signal delivered to one rank, or one rank's clock passing the limit, stops all of them after
// the same iteration.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "parallel/communicator.h"
#include "train/checkpoint_config.h"

namespace moecore::train {

class ExitConditions {
 public:
  // When cfg asks for the signal handler: blocks SIGTERM and SIGINT in the calling thread and the
  // OpenMP threads (no handler may interrupt a oneDNN GEMM: exit_conditions.cpp says why) and
  // installs a handler for the threads that do not block them; check() also takes a signal left
  // pending. The previous masks and handlers come back in the destructor. world: null for one
  // rank.
  ExitConditions(const CheckpointConfig& cfg, parallel::Communicator* world);
  ~ExitConditions();
  ExitConditions(const ExitConditions&) = delete;
  ExitConditions& operator=(const ExitConditions&) = delete;

  // Why the run stops after `iteration`; empty: it goes on. Collective over the world when a
  // signal handler or a duration is set (one all-reduce of one integer per iteration).
  std::string check(int64_t iteration);

  // The signal caught since the handler was installed (0: none); for tests.
  static int caught_signal();

 private:
  CheckpointConfig cfg_;
  parallel::Communicator* world_;
  std::chrono::steady_clock::time_point start_;
  bool handler_installed_ = false;
  sigset_t saved_mask_{};  // the calling thread's mask before, restored on every compute thread
};

}  // namespace moecore::train
