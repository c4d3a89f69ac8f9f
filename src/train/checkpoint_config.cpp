#include "train/checkpoint_config.h"

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
}

}  // namespace moecore::train
