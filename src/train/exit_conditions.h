// When a run stops before --train-iters: --exit-interval (after every multiple of it),
// --exit-duration-in-mins (once the run has taken that long) and --exit-signal-handler (SIGTERM,
// SIGINT, SIGHUP, SIGUSR1 or SIGUSR2, or an Open MPI launcher starting to kill the job: the step
// in flight finishes first). The trainer then saves a checkpoint (with --save) and returns;
// `moecore train` exits with status 0. The ranks agree on every stop: a signal delivered to one
// rank, or one rank's clock passing the limit, stops all of them after the same iteration. How
// each way of stopping a job reaches the ranks (mpirun, Slurm) is docs/checkpoint_format.md
// "Stopping a job".
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
  // With cfg's signal handler, the signals blocked by block_signals_in_every_thread (done here
  // when the process has no other thread yet; an error otherwise, or when any thread but the
  // signal thread accepts them) are taken as stops from now on: check() reports the first.
  // world: null for one rank.
  ExitConditions(const CheckpointConfig& cfg, parallel::Communicator* world);
  // The signals go back to the process's dispositions, unless the launcher is killing the job.
  ~ExitConditions();
  ExitConditions(const ExitConditions&) = delete;
  ExitConditions& operator=(const ExitConditions&) = delete;

  // Why the run stops after `iteration`; empty: it goes on. Collective over the world when a
  // signal handler or a duration is set (one all-reduce of one integer per iteration).
  std::string check(int64_t iteration);

  // --exit-signal-handler's part for the whole process, called while the calling thread is the
  // process's only one (`moecore train` does it before MPI and OpenMP start theirs): blocks the
  // signals the handler takes in that thread, so that every thread created afterwards (OpenMP's
  // in any team, nested or not, oneDNN's, Open MPI's, the background save's) starts with them
  // blocked and none can take one inside a oneDNN GEMM (exit_conditions.cpp says why), and starts
  // the one thread that takes them (sigwaitinfo; it never computes). Without an ExitConditions
  // that handles them, a signal taken there meets the process's own disposition, as if it had
  // never been blocked (SIGTERM's default ends the process). A process forked afterwards starts
  // with the mask from before. Returns false and changes nothing when other threads exist
  // (their masks cannot be set from here); true once blocked.
  static bool block_signals_in_every_thread();
  // The thread that takes the signals (its kernel thread id; 0 while none); for tests.
  static pid_t signal_thread_id();
  // How many signals that thread has taken since the process started; for tests, which wait for
  // a signal they sent to be taken.
  static int64_t signals_taken();

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
  bool armed_ = false;  // this object takes the signals as stops
};

}  // namespace moecore::train
