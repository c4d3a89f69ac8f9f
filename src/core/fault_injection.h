// Faults injected on purpose by the robustness tests, named by the environment variable
// MOECORE_FAULT (docs/testing.md): a ';'-separated list of "<kind>[:key=value]...", e.g.
//   MOECORE_FAULT="nan_loss:rank=1:iter=3;kill:at=publish.after_rename_aside"
// Each kind is acted on at exactly one place in the code, which asks for it with find(); with the
// variable unset every query is a cheap "no". A malformed value throws naming it, so a test can
// never pass because its fault was silently ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moecore::fault {

struct Fault {
  std::string kind;
  std::vector<std::pair<std::string, std::string>> args;  // in the order written

  // The value of `key`; nullopt when absent.
  std::optional<std::string> arg(std::string_view key) const;
  // The integer value of `key`; `fallback` when absent; throws when it is not an integer.
  int64_t int_arg(std::string_view key, int64_t fallback) const;
  // Whether "rank" and "iter" (each: any when absent) name this rank and iteration; -1 for a
  // value the caller does not know matches only an absent key.
  bool matches(int rank, int64_t iteration) const;
};

// Parses a MOECORE_FAULT value ("" gives none).
std::vector<Fault> parse(std::string_view spec);
// The faults of this process's environment, parsed on first use.
const std::vector<Fault>& injected();
// Tests only: replaces this process's faults by `spec`'s (a forked child that is to die at one
// point; the environment was read when its parent first asked). Not thread-safe.
void inject_for_test(std::string_view spec);
// The first injected fault of `kind` that matches(rank, iteration); null when none.
const Fault* find(std::string_view kind, int rank = -1, int64_t iteration = -1);
// The iteration a running step is at (the trainer sets it as each step starts; -1 outside
// training), for the faults of code that does not know it (the communicator, the emulated
// device's stream) and the stream-wait watchdog's report (core/exec.h).
void set_iteration(int64_t iteration);
int64_t iteration();
// Sleeps inside `point` (a communicator call's name, e.g. "all_to_all_v", or "save") when
// MOECORE_FAULT holds "sleep:in=<point>:seconds=S" (with optional rank=R and iter=N, the
// iteration being iteration()): a rank that hangs, or a save that takes long.
void sleep_point(std::string_view point, int rank = -1);
// Kills the process with SIGKILL (what a crash, an OOM killer or a lost node does) when
// MOECORE_FAULT holds "kill:at=<point>" (with an optional rank=R) for this point.
void kill_point(std::string_view point, int rank = -1);

}  // namespace moecore::fault
