#include "train/exit_conditions.h"

#include <fmt/format.h>
#include <signal.h>

#include <vector>

#include "core/check.h"

namespace moecore::train {
namespace {

volatile sig_atomic_t g_caught = 0;
struct sigaction g_previous[2];
constexpr int kSignals[2] = {SIGTERM, SIGINT};

extern "C" void on_exit_signal(int sig) {
  g_caught = sig;
}

}  // namespace

ExitConditions::ExitConditions(const CheckpointConfig& cfg, parallel::Communicator* world)
    : cfg_(cfg), world_(world), start_(std::chrono::steady_clock::now()) {
  if (!cfg_.exit_signal_handler) return;
  g_caught = 0;
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
  for (int i = 0; i < 2; ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
}

int ExitConditions::caught_signal() {
  return g_caught;
}

std::string ExitConditions::check(int64_t iteration) {
  // 1: a signal, 2: the duration; the ranks take the largest.
  int64_t code = 0;
  if (cfg_.exit_signal_handler && g_caught != 0) code = 1;
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
