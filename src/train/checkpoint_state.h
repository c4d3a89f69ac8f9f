// The model part of a checkpoint's run state (docs/checkpoint_format.md, "Run state"): the
// sizes that fix the global tensors, keyed by the flag that sets each. Whatever writes a
// checkpoint (the trainer, a converter) records it; a load compares it first, so a checkpoint
// of another model is refused naming each flag that differs with both values. And how a
// parameter's slice is described in the checkpoint, and which rank writes it.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/manifest.h"
#include "model/config.h"
#include "nn/param_registry.h"

namespace moecore::train {

// {"--hidden-size": 64, "--num-experts": 8, "--moe-layer-freq": [1, 0, ...], ...}.
nlohmann::json model_signature(const ModelConfig& m);
// Throws naming every flag whose value differs between `saved` and `mine` (keys missing from
// `saved` are not compared: an older checkpoint records fewer). `where` names the checkpoint. A
// checkpoint that records the padded vocabulary ("--vocab-size (padded)", written while the
// padding took part in the softmax) is refused with its own message.
void check_same_model(const nlohmann::json& saved, const nlohmann::json& mine,
                      const std::string& where);

// Parameter slice s in the manifest: whole, or its one or two split dimensions with their
// parts; a rank's local tensor (row-major) is the slice's stored form, written as it is.
ckpt::SliceRef checkpoint_slice(const ParamSlice& s, std::string file = {});
// The local shape of slice s of a tensor of `global_shape`.
std::vector<int64_t> slice_shape(const std::vector<int64_t>& global_shape, const ParamSlice& s);

// A rank's place in the groups that decide who writes a parameter's slice.
struct HolderRanks {
  int dp_cp = 0;    // dense parameters are replicated over the dense data-parallel group
  int tp = 0;       // and, when not sharded, over the attention grid's TP group
  int expt_dp = 0;  // expert parameters over the expert-data-parallel group
  int expt_tp = 0;  // and, when not sharded, over expert TP
};
// The first holder of each distinct slice writes it, once: a dense parameter's by dense
// data-parallel rank 0 (each TP rank its own slice; a replicated one, Replicated or
// ReplicatedPartialGrad, only TP rank 0), an expert parameter's by expert-data-parallel rank 0
// (one replicated over expert TP only expert-TP rank 0). On one TP rank this is world rank 0
// for dense parameters, expert-DP rank 0 for expert ones.
bool first_holder(const ParamSpec& p, const HolderRanks& r);
// The TP half of that rule: whether this rank's slice of p is written by its TP rank (sharded
// slices by every TP rank, replicated ones by TP rank 0). The distributed optimizer's flat
// pieces of a replicated parameter are written by TP rank 0's data-parallel group only.
bool tp_first_holder(const ParamSpec& p, const HolderRanks& r);

// The distributed optimizer's share of a local slice that is no run of the flattened tensor:
// `numel` elements of -0.0, into which a rank copies its owned pieces; the sum of the group's
// buffers is the whole local slice exactly, bit for bit, in any order (x + -0 = x for every x,
// +0 and -0 included; a +0 fill would turn a -0 moment into +0).
std::vector<float> assembly_buffer(int64_t numel);

}  // namespace moecore::train
