// --exit-signal-handler (train/exit_conditions.h): while the handler is installed, the signals it
// handles are blocked in the calling thread and in every OpenMP thread, so no signal frame is
// ever pushed by a thread inside a oneDNN JIT GEMM (whose rsp may point into the heap); a signal
// sent to the process is still taken by the next check(), and the masks come back afterwards.
// SIGHUP, SIGUSR1 and SIGUSR2 stop the run as SIGTERM and SIGINT do (a SIGHUP's default action
// would end the run without its save); a SIGCONT from the launcher (the
// start of mpirun's kill sequence) does too, unless it resumes a stop (Ctrl-Z) or repeats a
// resume someone else sent.
#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <string>

#include <fmt/format.h>

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
    EXPECT_EQ(exits.check(2), "SIGTERM (--exit-signal-handler)");
    EXPECT_EQ(ExitConditions::caught_signal(), SIGTERM);
  }
  EXPECT_EQ(threads_accepting(SIGTERM), 3) << "the masks are restored with the handlers";
  EXPECT_EQ(threads_accepting(SIGINT), 3);
  omp_set_num_threads(threads_before);
}

TEST(ExitConditions, EachExitSignalStops) {
  for (int sig : {SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) {
    ExitConditions exits(with_signal_handler(), nullptr);
    EXPECT_EQ(threads_accepting(sig), 0) << sig;
    EXPECT_EQ(exits.check(1), "");
    ASSERT_EQ(::kill(::getpid(), sig), 0);
    EXPECT_EQ(exits.check(2), fmt::format("SIG{} (--exit-signal-handler)", sigabbrev_np(sig)));
    EXPECT_FALSE(ExitConditions::launcher_ending()) << "a signal from anyone but the launcher";
  }
  EXPECT_EQ(threads_accepting(SIGUSR1), omp_get_max_threads());
}

TEST(ExitConditions, SigcontOnlyFromTheLauncherStops) {
  ExitConditions::set_launcher_for_test(::getppid());  // not this process
  {
    ExitConditions exits(with_signal_handler(), nullptr);
    ASSERT_EQ(::kill(::getpid(), SIGCONT), 0);  // e.g. Slurm resuming a suspended job
    EXPECT_EQ(exits.check(1), "") << "a SIGCONT from another process stopped the run";
  }
  ExitConditions::set_launcher_for_test(0);
}

// The launcher (a child process here) forwards a Ctrl-Z, then the resume: the run goes on.
TEST(ExitConditions, ResumeAfterCtrlZGoesOn) {
  const pid_t self = ::getpid();
  ExitConditions exits(with_signal_handler(), nullptr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::kill(self, SIGTSTP);
    ::usleep(300 * 1000);  // the parent is stopped meanwhile (it takes SIGTSTP at its check)
    ::kill(self, SIGCONT);
    ::_exit(0);
  }
  ExitConditions::set_launcher_for_test(child);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(exits.check(1), "") << "the resume after a Ctrl-Z stopped the run";
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(exits.check(2), "");
  EXPECT_FALSE(ExitConditions::launcher_ending());
  ExitConditions::set_launcher_for_test(0);
}

// mpirun's kill sequence: SIGCONT, then SIGTERM after odls_base_sigkill_timeout. The first stops
// the run; once the handler is gone the process still survives the second (it ends by itself
// after the save, without MPI_Finalize).
TEST(ExitConditions, LaunchersSigcontStopsAndItsSigtermDoesNotKill) {
  ExitConditions::set_launcher_for_test(::getpid());  // kill() from here: si_pid is the launcher's
  {
    ExitConditions exits(with_signal_handler(), nullptr);
    EXPECT_EQ(exits.check(1), "");
    ASSERT_EQ(::kill(::getpid(), SIGCONT), 0);
    const std::string why = exits.check(2);
    EXPECT_NE(why.find("the launcher (mpirun) began to kill the job"), std::string::npos) << why;
    EXPECT_TRUE(ExitConditions::launcher_ending());
  }
  ASSERT_EQ(::kill(::getpid(), SIGTERM), 0);  // would end this test binary with the default action
  // Left as the launcher's kill leaves them; this test cleans up for the next ones.
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT, SIGTSTP}) sigaddset(&set, s);
  const timespec now{0, 0};
  EXPECT_EQ(sigtimedwait(&set, nullptr, &now), SIGTERM) << "the SIGTERM is left pending, harmless";
#pragma omp parallel
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT, SIGTSTP}) ::signal(s, SIG_DFL);
  ExitConditions::set_launcher_for_test(0);
}

TEST(ExitConditions, NoHandlerNoMaskChange) {
  CheckpointConfig c;  // --exit-signal-handler not given
  ExitConditions exits(c, nullptr);
  EXPECT_EQ(threads_accepting(SIGTERM), omp_get_max_threads());
  EXPECT_EQ(exits.check(1), "");
}

}  // namespace
}  // namespace moecore::train
