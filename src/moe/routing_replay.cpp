#include "moe/routing_replay.h"

#include "core/check.h"

namespace moecore::moe {

RoutingReplay::RoutingReplay(RoutingReplayMode mode, int64_t samples, int64_t seq_length,
                             int64_t topk)
    : mode_(mode), samples_(samples), seq_length_(seq_length), topk_(topk) {
  set_mode(mode);
  MOE_CHECK(samples > 0 && seq_length > 0 && topk > 0,
            "[routing replay] {} samples of {} positions, top-{}: every size must be positive",
            samples, seq_length, topk);
}

void RoutingReplay::set_mode(RoutingReplayMode mode) {
  MOE_CHECK(mode == RoutingReplayMode::Record || mode == RoutingReplayMode::Replay,
            "[routing replay] a routing replay records or replays");
  mode_ = mode;
}

std::vector<int32_t>& RoutingReplay::record_table(int64_t iteration, const std::string& layer) {
  std::vector<int32_t>& t = tables_[{iteration, layer}];
  if (t.empty()) t.assign(static_cast<size_t>(samples_ * seq_length_ * topk_), -1);
  return t;
}

bool RoutingReplay::has(int64_t iteration, const std::string& layer) const {
  return tables_.count({iteration, layer}) > 0;
}

const std::vector<int32_t>& RoutingReplay::table(int64_t iteration,
                                                 const std::string& layer) const {
  const auto it = tables_.find({iteration, layer});
  MOE_CHECK(it != tables_.end(),
            "[routing replay] nothing was recorded for iteration {} at {}: replay a run of the "
            "same model and iterations",
            iteration, layer);
  return it->second;
}

}  // namespace moecore::moe
