// --exit-signal-handler (train/exit_conditions.h): the signals it handles are blocked in the
// process's first thread before any other exists, so every thread of the process blocks them
// (OpenMP's, in teams larger than the one of the moment, nested, or created later, and any other)
// but the one signal thread, which takes them; no signal frame is ever pushed by a thread inside a
// oneDNN JIT GEMM (whose rsp may point into the heap). A signal sent to the process reaches the
// next check(); without an ExitConditions that handles it, it meets the process's disposition.
// SIGHUP, SIGUSR1 and SIGUSR2 stop the run as SIGTERM and SIGINT do (a SIGHUP's default action
// would end the run without its save); a SIGCONT from the launcher (the start of mpirun's kill
// sequence) does too, unless it resumes a stop (Ctrl-Z) or repeats a resume someone else sent.
#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/tiny_train_flags.h"
#include "core/fault_injection.h"
#include "train/exit_conditions.h"
#include "train/trainer.h"

namespace moecore::train {
namespace {

constexpr int kHandled[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT, SIGTSTP};

// As `moecore train` does before MPI and OpenMP start: static objects are built while the
// process has one thread, before gtest runs a test.
const bool g_blocked_at_start = ExitConditions::block_signals_in_every_thread();

// Every thread of the process but the signal thread that accepts one of the handled signals, as
// "TID (NAME) SigBlk MASK", read from /proc (which, unlike an OpenMP team, sees them all).
std::vector<std::string> threads_accepting() {
  std::vector<std::string> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    const std::string tid = task.path().filename().string();
    if (tid == std::to_string(ExitConditions::signal_thread_id())) continue;
    std::ifstream f(task.path() / "status");
    std::string line, name, mask;
    while (std::getline(f, line)) {
      if (line.rfind("Name:", 0) == 0) name = line.substr(6);
      if (line.rfind("SigBlk:", 0) == 0) mask = line.substr(8);
    }
    if (mask.empty()) continue;  // the thread ended meanwhile
    const uint64_t blocked = std::stoull(mask, nullptr, 16);
    for (int s : kHandled) {
      if ((blocked >> (s - 1) & 1) == 0) {
        out.push_back(fmt::format("{} ({}) SigBlk {}", tid, name, mask));
        break;
      }
    }
  }
  return out;
}

// The strings of `items`, one a line, to show what a check found.
template <class Items>
std::string joined(const Items& items) {
  std::string out;
  for (const std::string& s : items) out += s + "\n";
  return out;
}

// Whether the calling thread accepts one of the handled signals.
bool this_thread_accepts() {
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  for (int s : kHandled) {
    if (sigismember(&mask, s) != 1) return true;
  }
  return false;
}

// Threads of a team of `n` (the calling thread included), each with a nested team of `nested`
// when nested > 1, that accept a handled signal while they run.
int team_threads_accepting(int n, int nested) {
  int accepting = 0;
#pragma omp parallel num_threads(n) reduction(+ : accepting)
  {
    if (nested > 1) {
#pragma omp parallel num_threads(nested) reduction(+ : accepting)
      accepting += this_thread_accepts();
    } else {
      accepting += this_thread_accepts();
    }
  }
  return accepting;
}

// Waits until the signal thread has taken more than `before` signals.
void wait_taken(int64_t before) {
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ExitConditions::signals_taken() <= before) {
    ASSERT_LT(std::chrono::steady_clock::now(), limit) << "the signal thread took no signal";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Sends `sig` to the process, as mpirun or a scheduler does, and waits until it is taken.
void send_and_wait(int sig) {
  const int64_t before = ExitConditions::signals_taken();
  ASSERT_EQ(::kill(::getpid(), sig), 0);
  wait_taken(before);
}

CheckpointConfig with_signal_handler() {
  CheckpointConfig c;
  c.exit_signal_handler = true;
  return c;
}

TEST(ExitConditions, EveryThreadButTheSignalThreadBlocksThem) {
  ASSERT_TRUE(g_blocked_at_start) << "the test binary ran other threads before main";
  EXPECT_NE(ExitConditions::signal_thread_id(), 0);
  const int threads_before = omp_get_max_threads();
  const int levels_before = omp_get_max_active_levels();
  omp_set_max_active_levels(2);
  // Before the handler: a team of 4 (its idle threads stay in OpenMP's pool while teams of one
  // run, and compute in the next large team), nested teams, a thread of another library.
  std::atomic<bool> done{false};
  const auto idle = [&done] {
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  EXPECT_EQ(team_threads_accepting(2, 2), 0);
  EXPECT_EQ(team_threads_accepting(4, 1), 0);
  std::thread other(idle);
  omp_set_num_threads(1);  // the team of the moment when the handler comes: the calling thread
  {
    ExitConditions exits(with_signal_handler(), nullptr);
    EXPECT_EQ(joined(threads_accepting()), "")
        << "threads accept an exit signal while --exit-signal-handler is installed: a handler "
           "interrupting a oneDNN GEMM on one writes its frame into the heap";
    // Teams and threads created afterwards: a team of 6 on the pool's idle threads and new ones,
    // nested teams, a thread of another library.
    EXPECT_EQ(team_threads_accepting(6, 1), 0);
    EXPECT_EQ(team_threads_accepting(3, 3), 0);
    std::atomic<int> later_accepts{-1};
    std::thread later([&] {
      later_accepts = this_thread_accepts();
      idle();
    });
    while (later_accepts < 0) std::this_thread::yield();
    EXPECT_EQ(later_accepts, 0);
    EXPECT_EQ(joined(threads_accepting()), "");
    EXPECT_EQ(exits.check(1), "");
    send_and_wait(SIGTERM);
    EXPECT_EQ(exits.check(2), "SIGTERM (--exit-signal-handler)");
    EXPECT_EQ(ExitConditions::caught_signal(), SIGTERM);
    done = true;
    later.join();
  }
  other.join();
  EXPECT_EQ(joined(threads_accepting()), "") << "the block lasts as the process";
  omp_set_max_active_levels(levels_before);
  omp_set_num_threads(threads_before);
}

// A training run as `moecore train --exit-signal-handler --async-save` makes one, with a team of
// 3 OpenMP threads: while it runs (the step's GEMMs, the background save's thread, slowed to be
// seen), a thread scanning /proc/self/task finds no thread but the signal thread that accepts an
// exit signal.
TEST(ExitConditions, NoThreadOfATrainingRunAcceptsThem) {
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(3);
  cli::TrainFlags f = cli::tiny_train_flags();
  f.vocab_size = 64;
  f.model.hidden = 32;
  f.model.seq_length = 32;
  f.model.num_experts = 4;
  f.model.moe.ffn_hidden = 32;
  f.make_vocab_size_divisible_by = 64;
  f.train.train_iters = 4;
  f.train.micro_batch = 4;
  f.train.global_batch = 8;
  f.train.log_interval = 1000;
  f.train.lr.warmup_steps = 2;
  f.train.peak_gflops = 100;  // skip the start-up GEMM probe
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    fmt::format("moecore_exit_threads.{}", ::getpid());
  std::filesystem::remove_all(dir);
  f.train.ckpt.save = dir.string();
  f.train.ckpt.save_interval = 2;
  f.train.ckpt.async_save = true;
  f.train.ckpt.exit_signal_handler = true;
  cli::finalize_train_flags(f);
  fault::inject_for_test("sleep:in=save.background:seconds=1");

  std::atomic<bool> done{false};
  std::set<std::string> accepting;
  std::set<std::string> names;
  std::set<std::string> tids;
  std::thread scanner([&] {
    while (!done) {
      for (const std::string& t : threads_accepting()) accepting.insert(t);
      for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
        tids.insert(task.path().filename().string());
        std::ifstream status(task.path() / "status");
        std::string line;
        if (std::getline(status, line) && line.rfind("Name:", 0) == 0) names.insert(line.substr(6));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::ostringstream log;
  {
    train::Trainer trainer(f.model, f.train);
    EXPECT_EQ(trainer.run(log).size(), 4u) << log.str();
  }
  done = true;
  scanner.join();
  fault::inject_for_test("");
  omp_set_num_threads(threads_before);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(joined(accepting), "")
      << "threads accepted an exit signal during the run: a handler interrupting a oneDNN GEMM "
         "on one writes its frame into the heap";
  EXPECT_EQ(names.count("moecore-save"), 1u) << "the background save's thread was not seen";
  EXPECT_EQ(names.count("moecore-signals"), 1u);
  // This thread, the signal thread, the scanner, the save thread and 2 OpenMP workers at least.
  EXPECT_GE(tids.size(), 6u);
}

// The signal thread never holds up the process's end: exit() (armed, after a signal it took and
// with the launcher's kill sequence leaving the signals armed, or after the run) ends it.
TEST(ExitConditions, TheProcessExitsWithTheSignalThreadWaiting) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child runs this binary afresh
  EXPECT_EXIT(
      {
        ExitConditions::set_launcher_for_test(::getpid());
        auto* armed = new ExitConditions(with_signal_handler(), nullptr);
        send_and_wait(SIGCONT);  // the launcher's kill sequence: armed past the destructor
        delete armed;
        std::exit(ExitConditions::launcher_ending() ? 3 : 4);
      },
      ::testing::ExitedWithCode(3), "");
  EXPECT_EXIT(
      {
        { ExitConditions gone(with_signal_handler(), nullptr); }
        std::exit(5);
      },
      ::testing::ExitedWithCode(5), "");
}

TEST(ExitConditions, EachExitSignalStops) {
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) {
    ExitConditions exits(with_signal_handler(), nullptr);
    EXPECT_EQ(exits.check(1), "");
    send_and_wait(sig);
    EXPECT_EQ(exits.check(2), fmt::format("SIG{} (--exit-signal-handler)", sigabbrev_np(sig)));
    EXPECT_FALSE(ExitConditions::launcher_ending()) << "a signal from anyone but the launcher";
  }
}

// A library that unblocks the signals on a thread of its own: the handler is refused, naming it.
TEST(ExitConditions, RefusedWhileAnotherThreadAcceptsThem) {
  std::atomic<int> state{0};
  std::atomic<pid_t> tid{0};
  std::thread unblocking([&] {
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, SIGUSR2);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    tid = ::gettid();
    state = 1;
    while (state == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  while (state == 0) std::this_thread::yield();
  std::string error;
  try {
    ExitConditions exits(with_signal_handler(), nullptr);
  } catch (const std::exception& e) {
    error = e.what();
  }
  state = 2;
  unblocking.join();
  EXPECT_NE(error.find(fmt::format("thread {} (", tid.load())), std::string::npos) << error;
  EXPECT_NE(error.find("accepts SIGUSR2"), std::string::npos) << error;
}

// A process whose threads started before the signals were blocked (a caller that skipped
// block_signals_in_every_thread): the handler is refused rather than leaving them exposed.
TEST(ExitConditions, RefusedWhenThreadsStartedBeforeTheBlock) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // no signal thread here, and the mask from before the block
    std::atomic<bool> done{false};
    std::thread early([&done] {
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    int rc = 1;
    try {
      ExitConditions exits(with_signal_handler(), nullptr);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      if (what.find("were not blocked before the process started its other threads (2 threads") !=
          std::string::npos) {
        rc = 0;
      }
    }
    done = true;
    early.join();
    ::_exit(rc);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

std::atomic<int> g_test_handler_runs{0};
std::atomic<pid_t> g_test_handler_tid{0};
extern "C" void test_handler(int) {
  g_test_handler_tid = ::gettid();
  ++g_test_handler_runs;
}

// Without an ExitConditions that handles them (none yet, none given the flag, or the one gone),
// a signal meets the process's disposition: a handler runs on the signal thread, SIGTERM's
// default ends the process.
TEST(ExitConditions, WithoutTheHandlerTheProcessDispositionTakesThem) {
  struct sigaction sa = {};
  struct sigaction previous = {};
  sa.sa_handler = test_handler;
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &previous), 0);
  g_test_handler_runs = 0;
  {
    ExitConditions without(CheckpointConfig{}, nullptr);  // --exit-signal-handler not given
    send_and_wait(SIGUSR1);
    EXPECT_EQ(without.check(1), "");
  }
  { ExitConditions gone(with_signal_handler(), nullptr); }
  send_and_wait(SIGUSR1);
  EXPECT_EQ(g_test_handler_runs, 2);
  EXPECT_EQ(g_test_handler_tid, ExitConditions::signal_thread_id()) << "not the signal thread";
  EXPECT_EQ(ExitConditions::caught_signal(), 0);
  sigaction(SIGUSR1, &previous, nullptr);

  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child runs this binary afresh
  EXPECT_EXIT(
      {
        { ExitConditions gone(with_signal_handler(), nullptr); }
        ::kill(::getpid(), SIGTERM);
        std::this_thread::sleep_for(std::chrono::seconds(20));
        ::_exit(0);  // the SIGTERM was lost
      },
      ::testing::KilledBySignal(SIGTERM), "");
}

// A process forked by the run (Open MPI's singleton forks its orted) gets the mask from before.
TEST(ExitConditions, ForkedProcessGetsTheMaskBack) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(this_thread_accepts() ? 0 : 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST(ExitConditions, SigcontOnlyFromTheLauncherStops) {
  ExitConditions::set_launcher_for_test(::getppid());  // not this process
  {
    ExitConditions exits(with_signal_handler(), nullptr);
    send_and_wait(SIGCONT);  // e.g. Slurm resuming a suspended job
    EXPECT_EQ(exits.check(1), "") << "a SIGCONT from another process stopped the run";
  }
  ExitConditions::set_launcher_for_test(0);
}

// Whether process `pid` is stopped (state T in /proc/PID/stat).
bool is_stopped(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::getline(f, stat);
  const size_t end = stat.rfind(')');
  return end != std::string::npos && end + 2 < stat.size() && stat[end + 2] == 'T';
}

// A launcher (a child process here) stops the process with `stop` (SIGTSTP, which the signal
// thread takes and then stops the process; SIGSTOP, which no thread sees), then resumes it with
// SIGCONT: the run goes on. `taken`: the signals the signal thread takes meanwhile.
void expect_resume_goes_on(int stop, int64_t taken) {
  const pid_t self = ::getpid();
  ExitConditions exits(with_signal_handler(), nullptr);
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char c;
    if (::read(go[0], &c, 1) != 1) ::_exit(2);
    ::kill(self, stop);
    for (int ms = 0; !is_stopped(self); ++ms) {
      if (ms == 20000) ::_exit(3);
      ::usleep(1000);
    }
    ::usleep(100 * 1000);
    ::kill(self, SIGCONT);
    ::_exit(0);
  }
  ExitConditions::set_launcher_for_test(child);
  const int64_t before = ExitConditions::signals_taken();
  ASSERT_EQ(::write(go[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  wait_taken(before + taken - 1);
  EXPECT_EQ(exits.check(1), "") << "the resume after " << ::strsignal(stop) << " stopped the run";
  EXPECT_FALSE(ExitConditions::launcher_ending());
  ::close(go[0]);
  ::close(go[1]);
  ExitConditions::set_launcher_for_test(0);
}

// The launcher forwards a Ctrl-Z, then the resume: the SIGTSTP and the SIGCONT are taken.
TEST(ExitConditions, ResumeAfterCtrlZGoesOn) { expect_resume_goes_on(SIGTSTP, 2); }

// mpirun turns a Ctrl-Z into SIGSTOP to the ranks (Open MPI 4.1 never forwards the SIGTSTP), then
// `fg` into SIGCONT; Slurm's suspend and resume are the same pair: only the SIGCONT is taken.
TEST(ExitConditions, ResumeAfterSigstopGoesOn) { expect_resume_goes_on(SIGSTOP, 1); }

// mpirun's kill sequence: SIGCONT, then SIGTERM after odls_base_sigkill_timeout. The first stops
// the run; once the ExitConditions is gone the process still survives the second (it ends by
// itself after the save, without MPI_Finalize).
TEST(ExitConditions, LaunchersSigcontStopsAndItsSigtermDoesNotKill) {
  ExitConditions::set_launcher_for_test(::getpid());  // kill() from here: si_pid is the launcher's
  {
    ExitConditions exits(with_signal_handler(), nullptr);
    EXPECT_EQ(exits.check(1), "");
    send_and_wait(SIGCONT);
    const std::string why = exits.check(2);
    EXPECT_NE(why.find("the launcher (mpirun) began to kill the job"), std::string::npos) << why;
    EXPECT_TRUE(ExitConditions::launcher_ending());
  }
  send_and_wait(SIGTERM);  // would end this test binary with the default action
  EXPECT_EQ(ExitConditions::caught_signal(), SIGCONT) << "the first signal is the stop";
  // Left as the launcher's kill leaves them; a handler installed and gone puts them back.
  ExitConditions::set_launcher_for_test(0);
  { ExitConditions reset(with_signal_handler(), nullptr); }
  EXPECT_FALSE(ExitConditions::launcher_ending());
}

}  // namespace
}  // namespace moecore::train
