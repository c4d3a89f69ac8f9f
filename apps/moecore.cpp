// The moecore command line (thin: parsing and dispatch only).
#include <CLI/CLI.hpp>
#include <iostream>

#include "core/check.h"
#include "parallel/runtime.h"
#include "train/train_flags.h"
#include "train/trainer.h"

int main(int argc, char** argv) {
  using namespace moecore;
  CLI::App app{"moecore: Mixture-of-Experts training in C++"};
  app.require_subcommand(1);
  CLI::App* train_cmd = app.add_subcommand("train", "Train a model (Megatron-LM flag names)");
  train::TrainFlags flags = train::default_train_flags();
  train::add_train_flags(*train_cmd, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    parallel::Runtime rt = parallel::runtime_init(&argc, &argv);
    if (train_cmd->parsed()) {
      train::finalize_train_flags(flags);
      train::Trainer trainer(flags.model, flags.train);
      auto metrics = trainer.run(std::cout);
      if (rt.rank == 0) {
        std::cout << fmt::format("[train] final lm loss {:.4f}, entropy floor {:.4f} (gap {:.4f})\n",
                                 metrics.back().lm_loss, trainer.entropy_floor(),
                                 metrics.back().lm_loss - trainer.entropy_floor());
      }
    }
    parallel::runtime_finalize();
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    parallel::runtime_finalize();
    return 1;
  }
  return 0;
}
