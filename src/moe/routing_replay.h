// Routing replay (Megatron-Core's RouterReplay, moe_enable_routing_replay): one run records the
// top-k experts every MoE layer chose for every token, a later run routes its tokens to them
// instead of selecting its own. The later run's probabilities are gathered from its own scores
// at the replayed experts, and capacity, the aux losses and the balancing counts follow from
// them as from experts it selected (docs/router.md, "Routing replay").
//
// The routing is keyed by (iteration, layer, sample in the iteration's global batch, position in
// the sequence), so any parallel layout replays what any other recorded: each rank records and
// replays the rows of the tokens it routes. A run records or replays through a RoutingReplay
// given to its trainer (train::TrainConfig::routing_replay): the layout parity tests under
// --bf16 replay the one-rank run's routing (docs/numerics.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moe/config.h"

namespace moecore::moe {

class RoutingReplay {
 public:
  // samples: the global batch; seq_length: the whole sequence (S); topk: K. Throws unless all
  // are positive and mode is Record or Replay.
  RoutingReplay(RoutingReplayMode mode, int64_t samples, int64_t seq_length, int64_t topk);

  RoutingReplayMode mode() const { return mode_; }
  void set_mode(RoutingReplayMode mode);  // Record or Replay: a recorded store replays next
  int64_t samples() const { return samples_; }
  int64_t seq_length() const { return seq_length_; }
  int64_t topk() const { return topk_; }

  // The table of one iteration (1-based, the trainer's) and layer (its prefix, e.g.
  // "decoder.layers.3.mlp"): [samples, S, K] expert indices, -1 where none was recorded.
  // Recording creates it on first use, all -1.
  std::vector<int32_t>& record_table(int64_t iteration, const std::string& layer);
  // Throws moecore::Error naming the iteration and layer when nothing was recorded there.
  const std::vector<int32_t>& table(int64_t iteration, const std::string& layer) const;
  bool has(int64_t iteration, const std::string& layer) const;
  size_t tables() const { return tables_.size(); }

 private:
  RoutingReplayMode mode_;
  int64_t samples_, seq_length_, topk_;
  std::map<std::pair<int64_t, std::string>, std::vector<int32_t>> tables_;
};

}  // namespace moecore::moe
