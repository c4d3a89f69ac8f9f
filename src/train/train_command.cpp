#include "train/train_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "parallel/process_groups.h"
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
                      for (const std::string& n : flags->notices) std::cout << n << "\n";
                      flags->train.live_progress = isatty(STDOUT_FILENO) != 0;
                      // MPI is up already (apps/moecore.cpp); this returns the same runtime.
                      const parallel::Runtime rt = parallel::runtime_init(nullptr, nullptr);
                      parallel::ProcessGroups groups = parallel::init_process_groups(
                          flags->parallel, rt, model_dims(flags->model));
                      Trainer trainer(flags->model, flags->train, &groups);
                      auto metrics = trainer.run(std::cout);
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
}

}  // namespace moecore::train
