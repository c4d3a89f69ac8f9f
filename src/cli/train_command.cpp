#include "cli/train_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "parallel/device_assignment.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"
#include "cli/train_flags.h"
#include "train/exit_conditions.h"
#include "train/trainer.h"

namespace moecore::cli {

using train::Trainer;

Subcommand add_train_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand("train", "Train a model (Megatron-LM's flags and defaults)");
  // Every argument goes to parse_train_args, which has argparse's semantics (megatron_argv.h).
  cli->prefix_command();
  cli->set_help_flag();
  cli->allow_extras();
  Subcommand command{cli, [cli]() {
                      std::vector<std::string> args = cli->remaining();
                      if (args.size() == 1 && args[0] == "--flags-markdown") {
                        std::cout << train_flags_markdown();
                        return 0;
                      }
                      TrainFlags flags;
                      try {
                        flags = parse_train_args(args);
                      } catch (const CLI::CallForHelp&) {
                        std::cout << train_help();
                        return 0;
                      } catch (const CLI::ParseError& e) {
                        std::cerr << "error: [flags] " << e.what() << "\n";
                        return 2;
                      }
                      for (const std::string& n : flags.notices) std::cout << n << "\n";
                      // The redrawn line on a terminal only; under a launcher the rank's stdout
                      // is the launcher's pty even when mpirun writes to a log file.
                      flags.train.live_progress =
                          isatty(STDOUT_FILENO) != 0 && !parallel::started_by_launcher();
                      // MPI is up already (apps/moecore.cpp); this returns the same runtime.
                      const parallel::Runtime rt = parallel::runtime_init(nullptr, nullptr);
                      // Each process's GPU, before anything creates a CUDA context.
                      parallel::select_device(rt, parse_device(flags.train.device), std::cout);
                      parallel::ProcessGroups groups = parallel::init_process_groups(
                          flags.parallel, rt, model_dims(flags.model));
                      Trainer trainer(flags.model, flags.train, &groups);
                      std::vector<train::StepMetrics> metrics;
                      try {
                        metrics = trainer.run(std::cout);
                      } catch (const train::NumericFault& f) {
                        // Every rank stops here at the same iteration (rank 0 printed the
                        // summary): each rank that found something names it, and all exit
                        // with the guard's code, finalizing MPI normally.
                        if (f.what()[0] != '\0') {
                          const std::string line =
                              parallel::format_rank_error(rt, f.what()) + "\n";
                          std::cerr.write(line.data(), static_cast<std::streamsize>(line.size()));
                          std::cerr.flush();
                        }
                        return f.exit_code();
                      }
                      if (metrics.empty()) return 0;  // resumed at --train-iters already
                      const double last = metrics.back().lm_loss, floor = trainer.entropy_floor();
                      if (std::isnan(floor)) {
                        std::cout << fmt::format("[train] final lm loss {:.4f}\n", last);
                      } else {
                        std::cout << fmt::format(
                            "[train] final lm loss {:.4f}, entropy floor {:.4f} (gap {:.4f})\n",
                            last, floor, last - floor);
                      }
                      return 0;
                    }};
  // --exit-signal-handler blocks its signals in every thread: in this one, before any other
  // exists, so that each inherits the block (train/exit_conditions.h). A command line that does
  // not parse changes nothing here: the run reports it.
  command.before_threads = [cli]() {
    bool handler = false;
    try {
      handler = parse_train_args(cli->remaining()).train.ckpt.exit_signal_handler;
    } catch (...) {
    }
    if (handler) train::ExitConditions::block_signals_in_every_thread();
  };
  return command;
}

}  // namespace moecore::cli
