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
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <string_view>
#include <thread>
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
// Also handled: SIGCONT, which opens mpirun's kill sequence, and SIGTSTP (Ctrl-Z on a terminal
// that reaches the rank), to tell the SIGCONT of its resume from that one. (mpirun turns a Ctrl-Z
// into SIGSTOP to the ranks, whose resume take_signals sees: it never forwards the SIGTSTP.)
constexpr int kHandled[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT, SIGTSTP};

// Written by the signal thread and read by the main thread.
std::atomic<int> g_caught{0};
std::atomic<int> g_launcher_pid{0};
std::atomic<bool> g_launcher_ending{false};
std::atomic<bool> g_stopped_by_tstp{false};
std::atomic<int64_t> g_other_cont_ns{0};  // when a SIGCONT came from someone else (0: never)
std::atomic<int64_t> g_resumed_ns{0};     // when the process went on after a stop (0: not since)
std::atomic<bool> g_armed{false};         // an ExitConditions takes the signals as stops
std::atomic<pid_t> g_signal_tid{0};       // the signal thread (0: not started)
std::atomic<int64_t> g_taken{0};          // signals the signal thread has taken
sigset_t g_mask_before;  // the process's mask before the block, for the processes it forks

int64_t monotonic_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

// A signal taken while an ExitConditions handles them (and every SIGTSTP).
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
    // The SIGCONT that ended a stop by SIGSTOP (mpirun turns a Ctrl-Z into SIGSTOP to the ranks,
    // Slurm suspends so): taken within microseconds of take_signals seeing the stop end.
    const int64_t resumed = g_resumed_ns.exchange(0, std::memory_order_relaxed);
    if (resumed != 0 && now - resumed < int64_t{1000000000}) return;
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

sigset_t handled_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kHandled) sigaddset(&set, s);
  return set;
}

// A signal taken while no ExitConditions handles them gets what the process does with it
// otherwise: sent again to this thread, the one thread where it is unblocked for the moment, it
// meets the process's disposition (SIGTERM's default ends the process; SIGHUP under nohup is
// ignored) before tgkill returns. A default action ends or stops the process without running
// code on any thread; a handler someone installed runs here, on a thread that never computes.
void pass_on(int sig) {
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  ::tgkill(::getpid(), ::gettid(), sig);
  pthread_sigmask(SIG_BLOCK, &one, nullptr);
}

// The signal thread: every thread of the process blocks the signals, this one waits for them. A
// signal sent to the process goes to the thread that waits for it; one sent to another thread
// (tgkill) stays pending on that thread, which never takes it.
void take_signals() {
  const sigset_t set = handled_set();
  for (;;) {
    siginfo_t info{};
    const int sig = sigwaitinfo(&set, &info);
    if (sig <= 0) {
      // Linux fails sigwaitinfo with EINTR when the process was stopped and resumed (signal(7),
      // "Interruption of system calls and library functions by stop signals"): the SIGCONT that
      // resumed it is queued already and comes next. (A debugger attaching does it too.)
      if (errno == EINTR) g_resumed_ns.store(monotonic_ns(), std::memory_order_relaxed);
      continue;
    }
    if (sig == SIGTSTP || g_armed.load()) {
      on_signal(sig, &info);
    } else if (sig == SIGCONT) {
      // The kernel resumed the process when the SIGCONT came; its default does nothing more.
      g_stopped_by_tstp.store(false, std::memory_order_relaxed);
      g_resumed_ns.store(0, std::memory_order_relaxed);
    } else {
      pass_on(sig);
    }
    g_taken.fetch_add(1);
  }
}

// A process forked afterwards (Open MPI's singleton starts its orted so) is not part of the run:
// it gets the mask back, and has no signal thread.
void restore_mask_in_child() {
  sigprocmask(SIG_SETMASK, &g_mask_before, nullptr);
  g_signal_tid.store(0);
  g_armed.store(false);
}

int thread_count() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// The threads other than the signal thread that accept one of the handled signals, as
// "thread TID (NAME) accepts SIGX", from /proc (which sees every thread of the process).
std::string threads_accepting() {
  std::string out;
  const pid_t taker = g_signal_tid.load();
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    const std::string tid = task.path().filename().string();
    if (tid == std::to_string(taker)) continue;
    std::ifstream f(task.path() / "status");
    std::string line, name;
    uint64_t blocked = ~uint64_t{0};
    while (std::getline(f, line)) {
      if (line.rfind("Name:", 0) == 0) name = line.substr(line.find_first_not_of(" \t", 5));
      if (line.rfind("SigBlk:", 0) == 0) blocked = std::stoull(line.substr(7), nullptr, 16);
    }
    for (int s : kHandled) {
      if ((blocked >> (s - 1) & 1) == 0) {
        out += fmt::format("{}thread {} ({}) accepts SIG{}", out.empty() ? "" : ", ", tid, name,
                           sigabbrev_np(s));
        break;
      }
    }
  }
  return out;
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

bool ExitConditions::block_signals_in_every_thread() {
  if (g_signal_tid.load() != 0) return true;
  if (thread_count() != 1) return false;
  // The signals are blocked in every thread for as long as the process lasts, so no handler
  // ever runs on a thread that computes: oneDNN's JIT f32 GEMM kernels (x64; oneDNN issue 4845,
  // fixed upstream by PR 4855; Debian 12 ships 2.6) point rsp at a heap workspace for some
  // shapes, and a signal handled on that thread writes its ~3.5 KB frame below rsp, into the
  // heap. A SIGTERM during a GEMM corrupted the allocator (glibc "corrupted size vs. prev_size
  // while consolidating" in a later free()). Blocked here, before any other thread exists, they
  // are blocked in every thread created afterwards, whoever creates it: blocking them later in the
  // OpenMP team of the moment missed the pool's idle threads of an earlier, larger team (which
  // the next large team computes on), nested teams and threads of other libraries. (A blocked
  // SIGCONT still resumes a stopped process: only its handling waits.)
  const sigset_t set = handled_set();
  MOE_CHECK(pthread_sigmask(SIG_BLOCK, &set, &g_mask_before) == 0,
            "[train] --exit-signal-handler: cannot block the exit signals");
  static const int atfork = pthread_atfork(nullptr, nullptr, restore_mask_in_child);
  MOE_CHECK(atfork == 0, "[train] --exit-signal-handler: pthread_atfork failed ({})", atfork);
  // The thread owns the promise: set_value may still run in it after get() returned here.
  std::promise<pid_t> started;
  std::future<pid_t> tid = started.get_future();
  std::thread taker([started = std::move(started)]() mutable {
    pthread_setname_np(pthread_self(), "moecore-signals");
    started.set_value(::gettid());
    take_signals();
  });
  // Detached, never joined: it waits in sigwaitinfo for as long as the process lasts, holds no
  // lock and owns nothing that needs destroying, so exit() ends it with the others (a joinable
  // std::thread left at exit would call std::terminate; joining it would wait forever).
  taker.detach();
  g_signal_tid.store(tid.get());
  return true;
}

pid_t ExitConditions::signal_thread_id() {
  return g_signal_tid.load();
}

int64_t ExitConditions::signals_taken() {
  return g_taken.load();
}

ExitConditions::ExitConditions(const CheckpointConfig& cfg, parallel::Communicator* world)
    : cfg_(cfg), world_(world), start_(std::chrono::steady_clock::now()) {
  if (!cfg_.exit_signal_handler) return;
  if (g_signal_tid.load() == 0 && !block_signals_in_every_thread()) {
    MOE_FAIL(
        "[train] --exit-signal-handler: the exit signals were not blocked before the "
        "process started its other threads ({} threads run now), so threads that compute "
        "could take one: call ExitConditions::block_signals_in_every_thread() while the "
        "process has one thread (`moecore train` does it before MPI and OpenMP start)",
        thread_count());
  }
  // Every thread inherits the block unless it unblocks the signals itself: none may.
  const std::string accepting = threads_accepting();
  MOE_CHECK(accepting.empty(),
            "[train] --exit-signal-handler: {}, though only the signal thread may take the exit "
            "signals (a handler run inside a oneDNN GEMM writes its frame into the heap); a "
            "library unblocked them: run without --exit-signal-handler, or report the library",
            accepting);
  g_caught.store(0);
  g_launcher_ending.store(false);
  g_stopped_by_tstp.store(false);
  g_other_cont_ns.store(0);
  g_resumed_ns.store(0);
  if (g_launcher_pid.load() == 0) g_launcher_pid.store(open_mpi_launcher());
  g_armed.store(true);
  armed_ = true;
}

ExitConditions::~ExitConditions() {
  if (!armed_) return;
  // While the launcher kills the job, its SIGTERM follows its SIGCONT: the signals stay taken as
  // stops, so that SIGTERM does not kill the process between the save and its exit with status 0.
  if (launcher_ending()) return;
  g_armed.store(false);
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
