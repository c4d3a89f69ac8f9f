// The model part of a checkpoint's run state (docs/checkpoint_format.md, "Run state"): the
// sizes that fix the global tensors, keyed by the flag that sets each. Whatever writes a
// checkpoint (the trainer, a converter) records it; a load compares it first, so a checkpoint
// of another model is refused naming each flag that differs with both values.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace moecore::train {

// {"--hidden-size": 64, "--num-experts": 8, "--moe-layer-freq": [1, 0, ...], ...}.
nlohmann::json model_signature(const ModelConfig& m);
// Throws naming every flag whose value differs between `saved` and `mine` (keys missing from
// `saved` are not compared: an older checkpoint records fewer). `where` names the checkpoint.
void check_same_model(const nlohmann::json& saved, const nlohmann::json& mine,
                      const std::string& where);

}  // namespace moecore::train
