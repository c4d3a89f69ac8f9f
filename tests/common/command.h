// Running a command from a test, stdout and stderr together: run_command for a shell command,
// run_moecore for the moecore binary of this build with arguments.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "common/paths.h"

namespace moecore::testing {

struct CommandResult {
  int exit_code = -1;  // the exit status; 128 + N for a command killed by signal N
  std::string output;  // stdout and stderr together
  double seconds = 0;  // wall time of the command
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  const auto start = std::chrono::steady_clock::now();
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

inline CommandResult run_moecore(const std::string& args) {
  return run_command(moecore_binary() + " " + args);
}

}  // namespace moecore::testing
