#include "train/exit_conditions.h"

#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <ctime>
#include <vector>

#include "core/check.h"

namespace moecore::train {
namespace {

// Written by the handler on whichever thread the kernel picks (one of Open MPI's, whose threads
// do not block the signals) and read by the main thread: an atomic, lock-free so a handler may
// store into it.
std::atomic<int> g_caught{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler stores into g_caught");
struct sigaction g_previous[2];
constexpr int kSignals[2] = {SIGTERM, SIGINT};

extern "C" void on_exit_signal(int sig) {
  g_caught.store(sig, std::memory_order_relaxed);
}

sigset_t exit_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kSignals) sigaddset(&set, s);
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
  const sigset_t set = exit_signal_set();
  const timespec now{0, 0};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &now);
    if (sig > 0) {
      g_caught.store(sig, std::memory_order_relaxed);
    } else if (errno != EINTR) {
      return;  // EAGAIN: none pending
    }
  }
}

}  // namespace

ExitConditions::ExitConditions(const CheckpointConfig& cfg, parallel::Communicator* world)
    : cfg_(cfg), world_(world), start_(std::chrono::steady_clock::now()) {
  if (!cfg_.exit_signal_handler) return;
  g_caught.store(0);
  // SIGTERM and SIGINT are blocked in the threads that compute for as long as the run lasts, so
  // no handler ever runs on them: oneDNN's JIT f32 GEMM kernels (x64; oneDNN issue 4845, fixed
  // upstream by PR 4855; Debian 12 ships 2.6) point rsp at a heap workspace for some shapes, and
  // a signal handled on that thread writes its ~3.5 KB frame below rsp, into the heap. A SIGTERM
  // during a GEMM corrupted the allocator (glibc "corrupted size vs. prev_size while
  // consolidating" in a later free()). The kernel now hands the signal to a thread that does not
  // block it (Open MPI's progress threads, idle in poll) or leaves it pending for check().
  const sigset_t set = exit_signal_set();
  MOE_CHECK(pthread_sigmask(SIG_BLOCK, &set, &saved_mask_) == 0,
            "[train] --exit-signal-handler: cannot block SIGTERM and SIGINT");
  MOE_CHECK(set_compute_threads_mask(SIG_BLOCK, &set) == 0,
            "[train] --exit-signal-handler: cannot block SIGTERM and SIGINT in the OpenMP threads");
  struct sigaction sa {};
  sa.sa_handler = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a read or write in flight resumes; the loop sees the flag
  for (int i = 0; i < 2; ++i) {
    MOE_CHECK(sigaction(kSignals[i], &sa, &g_previous[i]) == 0,
              "[train] --exit-signal-handler: cannot install the handler of signal {}",
              kSignals[i]);
  }
  handler_installed_ = true;
}

ExitConditions::~ExitConditions() {
  if (!handler_installed_) return;
  // A signal still pending is taken now (it would otherwise reach the restored handlers).
  take_pending_signals();
  set_compute_threads_mask(SIG_SETMASK, &saved_mask_);
  for (int i = 0; i < 2; ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
}

int ExitConditions::caught_signal() {
  return g_caught.load(std::memory_order_relaxed);
}

std::string ExitConditions::check(int64_t iteration) {
  // 1: a signal, 2: the duration; the ranks take the largest.
  int64_t code = 0;
  if (cfg_.exit_signal_handler) {
    take_pending_signals();
    if (caught_signal() != 0) code = 1;
  }
  const double minutes =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
  if (cfg_.exit_duration_mins > 0 && minutes >= static_cast<double>(cfg_.exit_duration_mins))
    code = 2;
  if (world_ != nullptr && (cfg_.exit_signal_handler || cfg_.exit_duration_mins > 0)) {
    std::vector<int64_t> v{code};
    world_->all_reduce(v, parallel::ReduceOp::Max);
    code = v[0];
  }
  if (code == 1) return "a termination signal (--exit-signal-handler)";
  if (code == 2) return fmt::format("--exit-duration-in-mins {} reached", cfg_.exit_duration_mins);
  if (cfg_.exit_interval > 0 && iteration % cfg_.exit_interval == 0)
    return fmt::format("--exit-interval {}", cfg_.exit_interval);
  return {};
}

}  // namespace moecore::train
