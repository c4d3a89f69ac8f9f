// The moecore command line (thin: each area registers its subcommands).
#include <CLI/CLI.hpp>
#include <iostream>
#include <vector>

#include "core/check.h"
#include "parallel/runtime.h"
#include "train/train_command.h"

int main(int argc, char** argv) {
  using namespace moecore;
  CLI::App app{"moecore: Mixture-of-Experts training in C++"};
  app.require_subcommand(1);
  std::vector<Subcommand> commands = {
      train::add_train_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  int rc = 0;
  try {
    parallel::runtime_init(&argc, &argv);
    for (Subcommand& c : commands) {
      if (c.cli->parsed()) rc = c.run();
    }
    parallel::runtime_finalize();
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    parallel::runtime_finalize();
    return 1;
  }
  return rc;
}
