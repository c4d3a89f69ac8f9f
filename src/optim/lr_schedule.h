// Megatron's learning-rate schedule (OptimizerParamScheduler.get_lr): linear warmup from
// --lr-warmup-init (default 0) to the peak over --lr-warmup-iters, then constant | linear | cosine
// | WSD decay to --min-lr at
// --lr-decay-iters, min_lr after. `step` is the number of optimizer steps already taken, so
// the first iteration uses lr(0) (0 with warmup), as in Megatron.
#pragma once

#include <cstdint>
#include <string>

namespace moecore::optim {

enum class LrDecayStyle : uint8_t { Constant, Linear, Cosine, WSD };
enum class WsdDecayStyle : uint8_t { Linear, Cosine, Exponential, MinusSqrt };

struct LrSchedule {
  double max_lr = 1e-3;
  double min_lr = 0.0;
  double warmup_init = 0.0;  // --lr-warmup-init
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;  // 0: train_iters
  LrDecayStyle style = LrDecayStyle::Linear;
  int64_t wsd_decay_steps = 0;  // --lr-wsd-decay-iters
  WsdDecayStyle wsd_style = WsdDecayStyle::Exponential;

  void validate() const;
  double lr(int64_t step) const;
};

LrDecayStyle parse_lr_decay_style(const std::string& s);
WsdDecayStyle parse_wsd_decay_style(const std::string& s);

}  // namespace moecore::optim
