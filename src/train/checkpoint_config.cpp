#include "train/checkpoint_config.h"

#include <filesystem>

#include "core/check.h"

namespace moecore::train {

void CheckpointConfig::validate() const {
  MOE_CHECK(save_interval >= 0, "[flags] --save-interval={} must be >= 0", save_interval);
  MOE_CHECK(save_interval == 0 || !save.empty(),
            "[flags] --save-interval={} needs --save DIR (where to write the checkpoints)",
            save_interval);
  MOE_CHECK(exit_interval >= 0, "[flags] --exit-interval={} must be >= 0", exit_interval);
  MOE_CHECK(exit_duration_mins >= 0, "[flags] --exit-duration-in-mins={} must be >= 0",
            exit_duration_mins);
  MOE_CHECK(ckpt_step >= -1, "[flags] --ckpt-step={} must be >= 0", ckpt_step);
  MOE_CHECK(ckpt_step < 0 || !load.empty(), "[flags] --ckpt-step={} needs --load DIR", ckpt_step);
  MOE_CHECK(!finetune || !load.empty(),
            "[flags] --finetune needs --load DIR (the checkpoint whose weights to start from)");
  MOE_CHECK(!upcycling || !load.empty(),
            "[flags] --moe-use-upcycling needs --load DIR (the dense checkpoint to upcycle)");
  MOE_CHECK(!exit_on_missing_checkpoint || !load.empty(),
            "[flags] --exit-on-missing-checkpoint needs --load DIR");
  // A missing --load directory is a fresh run (Megatron's rule); a file there is a mistake.
  std::error_code ec;
  MOE_CHECK(load.empty() || !std::filesystem::exists(load, ec) ||
                std::filesystem::is_directory(load, ec),
            "[flags] --load '{}' is a file, not a checkpoint directory: give the --save "
            "directory of the run to load",
            load);
  MOE_CHECK(save.empty() || !std::filesystem::exists(save, ec) ||
                std::filesystem::is_directory(save, ec),
            "[flags] --save '{}' is not a directory (a file of that name exists): give a "
            "directory",
            save);
}

}  // namespace moecore::train
