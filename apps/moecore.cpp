// The moecore command line (thin: each area registers its subcommands).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "ckpt/checkpoint_command.h"
#include "convert/convert_command.h"
#include "core/check.h"
#include "data/dataset_info_command.h"
#include "data/preprocess_command.h"
#include "parallel/groups_command.h"
#include "parallel/runtime.h"
#include "plan/plan_command.h"
#include "train/exit_conditions.h"
#include "cli/config_file.h"
#include "cli/eval_command.h"
#include "cli/train_command.h"

namespace {

constexpr const char* kUnknownFailure =
    "an unexpected failure that carries no message (set MOECORE_DEBUG_ERRORS=1 and report it)";

// moecore's own errors say what failed and the fix; anything else that escapes a command (a
// library's exception) is a bug of ours, but the user still gets a message and an exit status,
// never an abort.
std::string user_message(const std::exception& e) {
  if (dynamic_cast<const moecore::Error*>(&e) != nullptr) return e.what();
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr ||
      dynamic_cast<const std::length_error*>(&e) != nullptr)  // a container asked for > max_size
    return "out of memory: a size given or implied does not fit in this machine's memory "
           "(lower it; `moecore plan` shows what a configuration needs)";
  return std::string("unexpected internal error (") + e.what() +
         "); please report it with the command line";
}

// Every rank's error reaches the terminal with its rank, as one write (stderr is unbuffered:
// piece by piece, the ranks' lines would interleave mid-line); then the whole job ends, so the
// other ranks do not wait for this one in a collective.
void report_and_abort(const moecore::parallel::Runtime& rt, const std::string& what) {
  const std::string line = moecore::parallel::format_rank_error(rt, what) + "\n";
  std::cerr.write(line.data(), static_cast<std::streamsize>(line.size()));
  std::cerr.flush();
  moecore::parallel::runtime_abort(rt, 1);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moecore;
  CLI::App app{"moecore: Mixture-of-Experts training in C++"};
  app.require_subcommand(1);
  // One per line (clang-format off: it would pack them into columns).
  // clang-format off
  std::vector<Subcommand> commands = {
      cli::add_train_command(app),
      cli::add_eval_command(app),
      parallel::add_groups_command(app),
      data::add_preprocess_command(app),
      data::add_dataset_info_command(app),
      plan::add_plan_command(app),
      ckpt::add_checkpoint_command(app),
      convert::add_convert_command(app),
  };
  // clang-format on
  try {
    // --config FILE expands into flags before the command line's own (which then override).
    std::vector<std::string> args(argv + 1, argv + argc);
    args = cli::expand_config_files(args);
    std::reverse(args.begin(), args.end());  // CLI11 takes the arguments reversed
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "error: " << user_message(e) << "\n";
    return 1;
  } catch (...) {
    std::cerr << "error: " << kUnknownFailure << "\n";
    return 1;
  }
  int rc = 0;
  parallel::Runtime rt;
  try {
    for (Subcommand& c : commands) {
      if (c.cli->parsed() && c.before_threads) c.before_threads();
    }
    rt = parallel::runtime_init(&argc, &argv);
    parallel::quiet_stdout_on_other_ranks(rt);  // rank 0 alone prints progress
    for (Subcommand& c : commands) {
      if (c.cli->parsed()) rc = c.run();
    }
    // mpirun is killing the job (--exit-signal-handler saw its SIGCONT or SIGTERM) and serves no
    // MPI_Finalize until its SIGKILL: the checkpoint is written, the process ends now.
    std::cout.flush();
    if (train::ExitConditions::launcher_ending()) parallel::runtime_exit_without_finalize(rc);
    parallel::runtime_finalize();
  } catch (const std::exception& e) {
    report_and_abort(rt, user_message(e));
  } catch (...) {
    report_and_abort(rt, kUnknownFailure);
  }
  return rc;
}
