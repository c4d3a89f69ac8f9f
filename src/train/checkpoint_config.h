// What a run saves and loads, and when it stops early: Megatron-LM's checkpointing flags
// (--save, --load, --save-interval, --async-save, --finetune, --no-save-optim, --no-load-optim,
// --no-save-rng, --no-load-rng, --ckpt-step, --exit-on-missing-checkpoint, --use-checkpoint-args)
// and its exit flags (--exit-interval, --exit-duration-in-mins, --exit-signal-handler). The
// format and the protocol are docs/checkpoint_format.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore::train {

struct CheckpointConfig {
  std::string save;           // --save: the checkpoints' directory ("": none)
  std::string load;           // --load: resume from its latest checkpoint ("": none)
  int64_t save_interval = 0;  // --save-interval (0: only when training ends or exits)
  bool finetune = false;      // --finetune: the weights only; optimizer, iteration, data
                              // position and random streams start at 0
  bool upcycling = false;     // --moe-use-upcycling: --load is a dense checkpoint
  bool save_optim = true;     // false: --no-save-optim
  bool load_optim = true;     // false: --no-load-optim
  bool save_rng = true;       // false: --no-save-rng
  bool load_rng = true;       // false: --no-load-rng
  bool async_save = false;    // --async-save: the step waits only for the copy to host
  int64_t ckpt_step = -1;     // --ckpt-step: load this iteration, not the tracker's
  bool exit_on_missing_checkpoint = false;  // --exit-on-missing-checkpoint
  int64_t exit_interval = 0;                // --exit-interval: save and stop after a multiple of it
  int64_t exit_duration_mins = 0;    // --exit-duration-in-mins: save and stop after that long
  bool exit_signal_handler = false;  // --exit-signal-handler: SIGTERM / SIGINT / SIGUSR1 /
                                     // SIGUSR2, or mpirun killing the job, finish the step, save
                                     // and stop (exit status 0)
  bool use_checkpoint_args = false;  // --use-checkpoint-args: the model's flags from --load
                                     // (cli/checkpoint_args.h)
  // The run's flags (its command line with config files expanded, each flag once), recorded in
  // every checkpoint's state ("args") for --use-checkpoint-args.
  std::vector<std::string> run_args;

  // Throws naming the flag for a value that cannot work.
  void validate() const;
};

// What a load takes from a checkpoint (BasicTrainer::load_checkpoint; --load's flags).
struct LoadOptions {
  bool optim = true;       // the moments and the step count (--no-load-optim: false)
  bool rng = true;         // the random streams' positions (--no-load-rng: false)
  bool finetune = false;   // the weights and router state only; everything else from 0
  int64_t iteration = -1;  // the iteration to load (--ckpt-step); -1: the tracker's
  // --moe-use-upcycling: a dense checkpoint into this MoE model, each expert a copy of its
  // layer's dense MLP, the routers as initialized; then as finetune.
  bool upcycle = false;
};

}  // namespace moecore::train
