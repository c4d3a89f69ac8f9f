#include "train/step_buffers.h"

#include <algorithm>

namespace moecore::train {

StepBuffers::StepBuffers(const Exec& ex, int64_t n_micro, int64_t tokens, int64_t E)
    : n_micro_(n_micro), tokens_(tokens), E_(std::max<int64_t>(E, 1)), arena_(ex) {
  MOE_CHECK(n_micro >= 1 && tokens >= 1 && E >= 0,
            "[train] step buffers for {} micro-batches of {} tokens and {} experts", n_micro,
            tokens, E);
  arena_.plan([this](Arena& a) { layout(a); });
}

void StepBuffers::layout(Arena& a) {
  ids_ = a.alloc<int32_t>(n_micro_ * tokens_, "step.ids");
  targets_ = a.alloc<int32_t>(n_micro_ * tokens_, "step.targets");
  report_ = a.alloc<ops::MicroBatchReport>(n_micro_, "step.report", MemKind::State);
  tokens_E_ = a.alloc<int64_t>(n_micro_ * E_, "step.tokens_per_expert", MemKind::State);
}

model::MicroBatchIO StepBuffers::io(int64_t mb) const {
  MOE_CHECK(mb >= 0 && mb < n_micro_, "[train] micro-batch {} of {}", mb, n_micro_);
  return model::MicroBatchIO{ids_ + mb * tokens_, targets_ + mb * tokens_, report_ + mb,
                             tokens_E_ + mb * E_};
}

}  // namespace moecore::train
