// The moecore command line (thin: each area registers its subcommands).
#include <CLI/CLI.hpp>
#include <iostream>
#include <vector>

#include "core/check.h"
#include "parallel/groups_command.h"
#include "parallel/runtime.h"
#include "train/train_command.h"

int main(int argc, char** argv) {
  using namespace moecore;
  CLI::App app{"moecore: Mixture-of-Experts training in C++"};
  app.require_subcommand(1);
  std::vector<Subcommand> commands = {
      train::add_train_command(app),
      parallel::add_groups_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  int rc = 0;
  parallel::Runtime rt;
  try {
    rt = parallel::runtime_init(&argc, &argv);
    parallel::quiet_stdout_on_other_ranks(rt);  // rank 0 alone prints progress
    for (Subcommand& c : commands) {
      if (c.cli->parsed()) rc = c.run();
    }
    parallel::runtime_finalize();
  } catch (const Error& e) {
    // Every rank's error reaches the terminal with its rank; then the whole job ends, so the
    // other ranks do not wait for this one in a collective.
    std::cerr << parallel::format_rank_error(rt, e.what()) << std::endl;
    parallel::runtime_abort(rt, 1);
  }
  return rc;
}
