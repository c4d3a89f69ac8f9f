// When a run stops before --train-iters: --exit-interval (after every multiple of it),
// --exit-duration-in-mins (once the run has taken that long) and --exit-signal-handler (SIGTERM,
// SIGINT, SIGHUP, SIGUSR1 or SIGUSR2, or an Open MPI launcher starting to kill the job: the step in flight
// finishes first). The trainer then saves a checkpoint (with --save) and returns; `moecore train`
// exits with status 0. The ranks agree on every stop: a signal delivered to one rank, or one
// rank's clock passing the limit, stops all of them after the same iteration. How each way of
// stopping a job reaches the ranks (mpirun, Slurm) is docs/checkpoint_format.md "Stopping a job".
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "parallel/communicator.h"
#include "train/checkpoint_config.h"

namespace moecore::train {

class ExitConditions {
 public:
  // When cfg asks for the signal handler: blocks the signals it handles in the calling thread and
  // the OpenMP threads (no handler may interrupt a oneDNN GEMM: exit_conditions.cpp says why) and
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

  // The first exit signal caught since the handler was installed (0: none; SIGCONT: the
  // launcher's, see launcher_ending); for tests.
  static int caught_signal();
  // Whether this process's launcher (mpirun or orted) has begun to kill the job: it sent the
  // SIGCONT that opens its kill sequence (SIGCONT, SIGTERM after odls_base_sigkill_timeout
  // seconds, SIGKILL after as many again) or its SIGTERM. The launcher then no longer serves the
  // ranks (MPI_Finalize would wait for it until the SIGKILL), so the process ends without it.
  static bool launcher_ending();
  // Treats `pid` as this process's launcher (0: none); for tests, which play mpirun themselves.
  static void set_launcher_for_test(pid_t pid);

 private:
  CheckpointConfig cfg_;
  parallel::Communicator* world_;
  std::chrono::steady_clock::time_point start_;
  bool handler_installed_ = false;
  sigset_t saved_mask_{};  // the calling thread's mask before, restored on every compute thread
};

}  // namespace moecore::train
