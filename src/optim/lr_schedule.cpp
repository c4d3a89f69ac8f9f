#include "optim/lr_schedule.h"

#include <cmath>

#include "core/check.h"

namespace moecore::optim {

void LrSchedule::validate() const {
  MOE_CHECK(max_lr >= 0 && min_lr >= 0 && min_lr <= max_lr,
            "[lr] need 0 <= --min-lr={} <= --lr={}", min_lr, max_lr);
  MOE_CHECK(warmup_steps >= 0 && (style == LrDecayStyle::Constant || decay_steps > warmup_steps ||
                                  decay_steps == 0),
            "[lr] --lr-decay-iters={} must exceed --lr-warmup-iters={}", decay_steps,
            warmup_steps);
  MOE_CHECK(style != LrDecayStyle::WSD || (wsd_decay_steps > 0 && wsd_decay_steps <= decay_steps),
            "[lr] WSD needs 0 < --lr-wsd-decay-iters={} <= --lr-decay-iters={}", wsd_decay_steps,
            decay_steps);
}

double LrSchedule::lr(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps) {
    return warmup_init +
           (max_lr - warmup_init) * static_cast<double>(step) / static_cast<double>(warmup_steps);
  }
  if (style == LrDecayStyle::Constant) return max_lr;
  if (step > decay_steps) return min_lr;
  const double ratio = static_cast<double>(step - warmup_steps) /
                       static_cast<double>(decay_steps - warmup_steps);
  double coeff = 1.0;
  switch (style) {
    case LrDecayStyle::Linear: coeff = 1.0 - ratio; break;
    case LrDecayStyle::Cosine: coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0); break;
    case LrDecayStyle::WSD: {
      const int64_t anneal_start = decay_steps - wsd_decay_steps;
      if (step <= anneal_start) {
        coeff = 1.0;
      } else {
        double r = static_cast<double>(step - anneal_start) / static_cast<double>(wsd_decay_steps);
        switch (wsd_style) {
          case WsdDecayStyle::Linear: coeff = 1.0 - r; break;
          case WsdDecayStyle::Cosine: coeff = 0.5 * (std::cos(M_PI * r) + 1.0); break;
          case WsdDecayStyle::Exponential: coeff = 2.0 * std::pow(0.5, r) - 1.0; break;
          case WsdDecayStyle::MinusSqrt: coeff = 1.0 - std::sqrt(r); break;
        }
      }
      break;
    }
    case LrDecayStyle::Constant: break;
  }
  return min_lr + coeff * (max_lr - min_lr);
}

LrDecayStyle parse_lr_decay_style(const std::string& s) {
  if (s == "constant") return LrDecayStyle::Constant;
  if (s == "linear") return LrDecayStyle::Linear;
  if (s == "cosine") return LrDecayStyle::Cosine;
  if (s == "WSD") return LrDecayStyle::WSD;
  MOE_FAIL("[lr] unknown --lr-decay-style '{}': use constant, linear, cosine or WSD", s);
}

WsdDecayStyle parse_wsd_decay_style(const std::string& s) {
  if (s == "linear") return WsdDecayStyle::Linear;
  if (s == "cosine") return WsdDecayStyle::Cosine;
  if (s == "exponential") return WsdDecayStyle::Exponential;
  if (s == "minus_sqrt") return WsdDecayStyle::MinusSqrt;
  MOE_FAIL("[lr] unknown --lr-wsd-decay-style '{}': use linear, cosine, exponential or minus_sqrt",
           s);
}

}  // namespace moecore::optim
