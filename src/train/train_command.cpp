#include "train/train_command.h"

#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "parallel/runtime.h"
#include "train/train_flags.h"
#include "train/trainer.h"

namespace moecore::train {

Subcommand add_train_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand("train", "Train a model (Megatron-LM flag names)");
  auto flags = std::make_shared<TrainFlags>(default_train_flags());
  add_train_flags(*cli, *flags);
  return Subcommand{cli, [flags]() {
                      finalize_train_flags(*flags);
                      Trainer trainer(flags->model, flags->train);
                      auto metrics = trainer.run(std::cout);
                      std::cout << fmt::format(
                          "[train] final lm loss {:.4f}, entropy floor {:.4f} (gap {:.4f})\n",
                          metrics.back().lm_loss, trainer.entropy_floor(),
                          metrics.back().lm_loss - trainer.entropy_floor());
                      return 0;
                    }};
}

}  // namespace moecore::train
