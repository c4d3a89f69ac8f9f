// A `moecore` subcommand: its CLI11 parser and the function that runs it once parsed. Each area
// registers its own (cli/train_command.h, ...); apps/moecore.cpp only lists them.
#pragma once

#include <functional>

namespace CLI {
class App;  // <CLI/CLI.hpp> (heavy) in the .cpp files that build parsers
}  // namespace CLI

namespace moecore {

struct Subcommand {
  CLI::App* cli = nullptr;
  std::function<int()> run;  // returns the process exit code
};

}  // namespace moecore
