#include "train/exit_conditions.h"

#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <ctime>
#include <fstream>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "parallel/runtime.h"

namespace moecore::train {
namespace {

// The signals that stop the run. SIGTERM: what a scheduler (scancel, Kubernetes) and `kill` send;
// SIGINT: Ctrl-C; SIGHUP: the terminal or ssh session of a run started without nohup closing
// (its default action would kill the run without its save); SIGUSR1 and SIGUSR2: what
// schedulers send ahead of the end of a time limit (Slurm's --signal=USR1@120), and what mpirun
// forwards to every rank (it forwards neither SIGTERM, SIGINT nor SIGHUP: on those it kills the
// job itself).
constexpr int kExitSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2};
// Also handled: SIGCONT, which opens mpirun's kill sequence, and SIGTSTP, to tell the SIGCONT of
// a resume after Ctrl-Z (which mpirun forwards as well) from that one.
constexpr int kHandled[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT, SIGTSTP};
constexpr int kNumHandled = sizeof(kHandled) / sizeof(kHandled[0]);

// Written by the handler on whichever thread the kernel picks (one of Open MPI's, whose threads
// do not block the signals) and read by the main thread: atomics, lock-free so a handler may
// store into them.
std::atomic<int> g_caught{0};
std::atomic<int> g_launcher_pid{0};
std::atomic<bool> g_launcher_ending{false};
std::atomic<bool> g_stopped_by_tstp{false};
std::atomic<int64_t> g_other_cont_ns{0};  // when a SIGCONT came from someone else (0: never)
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler stores into g_caught");
static_assert(std::atomic<int64_t>::is_always_lock_free, "the signal handler stores into it");
struct sigaction g_previous[kNumHandled];

int64_t monotonic_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);  // async-signal-safe
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

// Async-signal-safe: called by the handler and, for a signal left pending, by check().
void on_signal(int sig, const siginfo_t* info) {
  const pid_t launcher = g_launcher_pid.load(std::memory_order_relaxed);
  const bool from_launcher =
      launcher != 0 && info != nullptr && info->si_code == SI_USER && info->si_pid == launcher;
  if (sig == SIGTSTP) {
    // SIGTSTP's default action (stop), remembering that the next SIGCONT is the resume.
    g_stopped_by_tstp.store(true, std::memory_order_relaxed);
    ::kill(::getpid(), SIGSTOP);
    return;
  }
  if (sig == SIGCONT) {
    if (g_stopped_by_tstp.exchange(false, std::memory_order_relaxed)) return;  // a resume
    const int64_t now = monotonic_ns();
    if (!from_launcher) {
      g_other_cont_ns.store(now, std::memory_order_relaxed);  // e.g. Slurm resuming a suspend
      return;
    }
    // mpirun forwards the SIGCONT it got itself: a resume that someone else sent us too.
    const int64_t other = g_other_cont_ns.load(std::memory_order_relaxed);
    if (other != 0 && now - other < int64_t{5} * 1000000000) return;
  }
  // Open MPI's launchers never forward SIGCONT unasked, SIGTERM or SIGINT: from them, these mean
  // the job is being killed.
  if (from_launcher && (sig == SIGCONT || sig == SIGTERM || sig == SIGINT)) {
    g_launcher_ending.store(true, std::memory_order_relaxed);
  }
  int none = 0;
  g_caught.compare_exchange_strong(none, sig, std::memory_order_relaxed);
}

extern "C" void on_exit_signal(int sig, siginfo_t* info, void*) {
  const int saved_errno = errno;
  on_signal(sig, info);
  errno = saved_errno;
}

sigset_t handled_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kHandled) sigaddset(&set, s);
  return set;
}

// Sets the mask of the calling thread and of every OpenMP thread (the threads that run the
// step's ops and oneDNN's GEMMs; threads the pool creates later copy the calling thread's).
// Returns on how many threads pthread_sigmask failed.
int set_compute_threads_mask(int how, const sigset_t* set) {
  int failed = pthread_sigmask(how, set, nullptr) != 0;
#pragma omp parallel reduction(+ : failed)
  failed += pthread_sigmask(how, set, nullptr) != 0;
  return failed;
}

// A signal pending on the process (no thread accepts it: every thread blocks it, as in a run
// without Open MPI's threads) is taken here, on the main thread, at the iteration's check.
void take_pending_signals() {
  const sigset_t set = handled_set();
  const timespec now{0, 0};
  for (;;) {
    siginfo_t info{};
    const int sig = sigtimedwait(&set, &info, &now);
    if (sig > 0) {
      on_signal(sig, &info);
    } else if (errno != EINTR) {
      return;  // EAGAIN: none pending
    }
  }
}

// The parent when it is an Open MPI launcher (mpirun on the first node, orted on the others;
// prterun / prted for Open MPI 5), whose kill sequence starts with a SIGCONT; 0 otherwise.
pid_t open_mpi_launcher() {
  if (!parallel::started_by_launcher()) return 0;
  const pid_t parent = ::getppid();
  std::ifstream f(fmt::format("/proc/{}/comm", parent));
  std::string comm;
  std::getline(f, comm);
  for (std::string_view name : {"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"}) {
    if (comm == name) return parent;
  }
  return 0;
}

std::string signal_reason(int sig) {
  if (sig == SIGCONT) {
    return "the launcher (mpirun) began to kill the job (its SIGCONT, ahead of SIGTERM and "
           "SIGKILL; --exit-signal-handler)";
  }
  const char* name = sigabbrev_np(sig);
  if (name == nullptr) return fmt::format("signal {} (--exit-signal-handler)", sig);
  return fmt::format("SIG{} (--exit-signal-handler)", name);
}

}  // namespace

ExitConditions::ExitConditions(const CheckpointConfig& cfg, parallel::Communicator* world)
    : cfg_(cfg), world_(world), start_(std::chrono::steady_clock::now()) {
  if (!cfg_.exit_signal_handler) return;
  g_caught.store(0);
  g_launcher_ending.store(false);
  g_stopped_by_tstp.store(false);
  g_other_cont_ns.store(0);
  if (g_launcher_pid.load() == 0) g_launcher_pid.store(open_mpi_launcher());
  // The signals are blocked in the threads that compute for as long as the run lasts, so no
  // handler ever runs on them: oneDNN's JIT f32 GEMM kernels (x64; oneDNN issue 4845, fixed
  // upstream by PR 4855; Debian 12 ships 2.6) point rsp at a heap workspace for some shapes, and
  // a signal handled on that thread writes its ~3.5 KB frame below rsp, into the heap. A SIGTERM
  // during a GEMM corrupted the allocator (glibc "corrupted size vs. prev_size while
  // consolidating" in a later free()). The kernel now hands the signal to a thread that does not
  // block it (Open MPI's progress threads, idle in poll) or leaves it pending for check(). (A
  // blocked SIGCONT still resumes a stopped process: only its handler waits.)
  const sigset_t set = handled_set();
  MOE_CHECK(pthread_sigmask(SIG_BLOCK, &set, &saved_mask_) == 0,
            "[train] --exit-signal-handler: cannot block the exit signals");
  MOE_CHECK(set_compute_threads_mask(SIG_BLOCK, &set) == 0,
            "[train] --exit-signal-handler: cannot block the exit signals in the OpenMP threads");
  struct sigaction sa {};
  sa.sa_sigaction = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_SIGINFO | SA_RESTART;  // a read or write in flight resumes; the loop sees it
  for (int i = 0; i < kNumHandled; ++i) {
    MOE_CHECK(sigaction(kHandled[i], &sa, &g_previous[i]) == 0,
              "[train] --exit-signal-handler: cannot install the handler of signal {}",
              kHandled[i]);
  }
  handler_installed_ = true;
}

ExitConditions::~ExitConditions() {
  if (!handler_installed_) return;
  // A signal still pending is taken now (it would otherwise reach the restored handlers).
  take_pending_signals();
  // While the launcher kills the job, its SIGTERM follows its SIGCONT: the handlers stay, so that
  // SIGTERM does not kill the process between the save and its exit with status 0.
  if (launcher_ending()) return;
  set_compute_threads_mask(SIG_SETMASK, &saved_mask_);
  for (int i = 0; i < kNumHandled; ++i) sigaction(kHandled[i], &g_previous[i], nullptr);
}

int ExitConditions::caught_signal() {
  return g_caught.load(std::memory_order_relaxed);
}

bool ExitConditions::launcher_ending() {
  return g_launcher_ending.load(std::memory_order_relaxed);
}

void ExitConditions::set_launcher_for_test(pid_t pid) {
  g_launcher_pid.store(pid);
}

std::string ExitConditions::check(int64_t iteration) {
  // The signal's number, or kDuration; the ranks take the largest (the launcher's SIGCONT, 18,
  // above the plain signals it may come with), so they all give the same reason.
  constexpr int64_t kDuration = 1000;
  int64_t code = 0;
  if (cfg_.exit_signal_handler) {
    take_pending_signals();
    code = caught_signal();
    if (launcher_ending()) code = SIGCONT;
  }
  const double minutes =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
  if (cfg_.exit_duration_mins > 0 && minutes >= static_cast<double>(cfg_.exit_duration_mins))
    code = kDuration;
  if (world_ != nullptr && (cfg_.exit_signal_handler || cfg_.exit_duration_mins > 0)) {
    std::vector<int64_t> v{code};
    world_->all_reduce(v, parallel::ReduceOp::Max);
    code = v[0];
  }
  if (code == kDuration)
    return fmt::format("--exit-duration-in-mins {} reached", cfg_.exit_duration_mins);
  if (code != 0) return signal_reason(static_cast<int>(code));
  if (cfg_.exit_interval > 0 && iteration % cfg_.exit_interval == 0)
    return fmt::format("--exit-interval {}", cfg_.exit_interval);
  return {};
}

}  // namespace moecore::train
