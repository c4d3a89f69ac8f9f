// --exit-signal-handler (train/exit_conditions.h): while the handler is installed, SIGTERM and
// SIGINT are blocked in the calling thread and in every OpenMP thread, so no signal frame is
// ever pushed by a thread inside a oneDNN JIT GEMM (whose rsp may point into the heap); a signal
// sent to the process is still taken by the next check(), and the masks come back afterwards.
#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <string>

#include "train/exit_conditions.h"

namespace moecore::train {
namespace {

// Threads of the current OpenMP team (the calling thread included) that accept `sig`.
int threads_accepting(int sig) {
  int accepting = 0;
#pragma omp parallel reduction(+ : accepting)
  {
    sigset_t mask;
    pthread_sigmask(SIG_BLOCK, nullptr, &mask);
    accepting += sigismember(&mask, sig) != 1;
  }
  return accepting;
}

CheckpointConfig with_signal_handler() {
  CheckpointConfig c;
  c.exit_signal_handler = true;
  return c;
}

TEST(ExitConditions, SignalsBlockedOnComputeThreadsAndTakenAtCheck) {
  // Three OpenMP threads, started before the handler as the trainer's are (the suite runs with
  // OMP_NUM_THREADS=1, which would leave the workers out).
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(3);
  ASSERT_EQ(threads_accepting(SIGTERM), 3) << "the test starts with the signals unblocked";
  {
    ExitConditions exits(with_signal_handler(), nullptr);
    EXPECT_EQ(threads_accepting(SIGTERM), 0)
        << "threads that compute accept SIGTERM while --exit-signal-handler is installed: a "
           "handler interrupting a oneDNN GEMM writes its frame into the heap";
    EXPECT_EQ(threads_accepting(SIGINT), 0);
    EXPECT_EQ(exits.check(1), "");
    ASSERT_EQ(::kill(::getpid(), SIGTERM), 0);  // to the process, as mpirun or a scheduler sends it
    EXPECT_EQ(exits.check(2), "a termination signal (--exit-signal-handler)");
    EXPECT_EQ(ExitConditions::caught_signal(), SIGTERM);
  }
  EXPECT_EQ(threads_accepting(SIGTERM), 3) << "the masks are restored with the handlers";
  EXPECT_EQ(threads_accepting(SIGINT), 3);
  omp_set_num_threads(threads_before);
}

TEST(ExitConditions, NoHandlerNoMaskChange) {
  CheckpointConfig c;  // --exit-signal-handler not given
  ExitConditions exits(c, nullptr);
  EXPECT_EQ(threads_accepting(SIGTERM), omp_get_max_threads());
  EXPECT_EQ(exits.check(1), "");
}

}  // namespace
}  // namespace moecore::train
