#include <CLI/CLI.hpp>

#include "cli/checkpoint_flags.h"

namespace moecore::cli {

void add_checkpoint_flags(CLI::App& app, CheckpointConfig& c, CheckpointFlags& f) {
  const char* kCkpt = "Checkpointing";
  app.add_option("--save", c.save,
                 "Directory to save checkpoints to (iter_NNNNNNN/ per save, the tracker "
                 "latest_checkpointed_iteration.txt; docs/checkpoint_format.md)")
      ->group(kCkpt);
  app.add_option("--save-interval", c.save_interval,
                 "Iterations between saves (default: only when training ends or stops early)")
      ->group(kCkpt);
  app.add_option("--load", c.load,
                 "Directory to resume from: its latest checkpoint, in any parallel layout (none "
                 "there yet: train from the start)")
      ->group(kCkpt);
  app.add_flag("--async-save", c.async_save,
               "Write the checkpoint files in the background: the step waits only for the copy "
               "to host memory; the next save or the end of training waits for the files")
      ->group(kCkpt);
  app.add_flag("--finetune", c.finetune,
               "Load the weights only: optimizer, iteration, data position and random streams "
               "start at 0")
      ->group(kCkpt);
  app.add_flag("--moe-use-upcycling", c.upcycling,
               "--load a dense checkpoint into this MoE model: every expert a copy of its "
               "layer's dense MLP (--moe-ffn-hidden-size = --ffn-hidden-size), routers as "
               "initialized; optimizer, iteration and data start at 0")
      ->group(kCkpt);
  app.add_flag("--no-save-optim", f.no_save_optim, "Do not save the optimizer state")->group(kCkpt);
  app.add_flag("--no-load-optim", f.no_load_optim,
               "Do not load the optimizer state (a fresh AdamW; iteration and data kept)")
      ->group(kCkpt);
  app.add_flag("--no-save-rng", f.no_save_rng, "Do not save the random streams' positions")
      ->group(kCkpt);
  app.add_flag("--no-load-rng", f.no_load_rng,
               "Do not load the random streams' positions (the router jitter restarts)")
      ->group(kCkpt);
  app.add_option("--ckpt-step", c.ckpt_step, "Load this iteration instead of the latest")
      ->group(kCkpt);
  app.add_flag("--use-checkpoint-args", c.use_checkpoint_args,
               "Take the model's flags from the --load checkpoint (what the run that wrote it "
               "was given); flags given here win")
      ->group(kCkpt);
  app.add_flag("--exit-on-missing-checkpoint", c.exit_on_missing_checkpoint,
               "With --load: stop if there is no checkpoint there instead of starting afresh")
      ->group(kCkpt);
  const char* kTrain = "Training";
  app.add_option("--exit-interval", c.exit_interval,
                 "Save (with --save) and stop after an iteration that is a multiple of this")
      ->group(kTrain);
  app.add_option("--exit-duration-in-mins", c.exit_duration_mins,
                 "Save (with --save) and stop once the run has taken this many minutes")
      ->group(kTrain);
  app.add_flag("--exit-signal-handler", c.exit_signal_handler,
               "On SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2 or mpirun killing the job: finish the "
               "step, save (with --save), exit with status 0")
      ->group(kTrain);
  // Switches show their state as their default; Megatron's --no-* flags default to None.
  for (const char* name :
       {"--async-save", "--finetune", "--moe-use-upcycling", "--exit-on-missing-checkpoint",
        "--exit-signal-handler", "--use-checkpoint-args"}) {
    app.get_option(name)->default_str("false");
  }
}

void finalize_checkpoint_flags(CheckpointConfig& c, const CheckpointFlags& f) {
  c.save_optim = !f.no_save_optim;
  c.load_optim = !f.no_load_optim;
  c.save_rng = !f.no_save_rng;
  c.load_rng = !f.no_load_rng;
  c.validate();
}

}  // namespace moecore::cli
