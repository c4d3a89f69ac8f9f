// The model part of a checkpoint's run state (docs/checkpoint_format.md, "Run state"): the
// sizes that fix the global tensors and the settings that change what the layers and the routers
// compute with them, keyed by the flag that sets each. Whatever writes a
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

// {"--hidden-size": 64, "--num-experts": 8, "--moe-layer-freq": [1, 0, ...], ...}; with experts
// also the routing: "--moe-router-topk", "--moe-router-score-function", pre-softmax, the top-k
// scaling factor, the group limits, the expert bias, and whether Sinkhorn or quantile balancing
// chooses the experts.
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

// p's global tensor as a checkpoint holds it: dimension 0 cut to the model's rows
// (ParamSpec::model_rows: the padding rows past them are not stored, so the stored tensor is
// the same whatever the padding, and a checkpoint reshards between TP sizes that pad the
// vocabulary differently).
std::vector<int64_t> checkpoint_shape(const ParamSpec& p);

// A piece of a parameter's local tensor as a checkpoint holds it: the local elements [local,
// local + count) (row-major), stored as `slice` of the global tensor of checkpoint_shape (its
// file left empty). count 0: the piece is all padding, nothing is stored.
struct CheckpointPiece {
  ckpt::SliceRef slice;
  int64_t local = 0;
  int64_t count = 0;
};
// p's whole local slice, clipped to the model's rows: its rows of dimension 0 that are model
// rows are a prefix of its local storage (dimension 0 is the outermost), so the piece is that
// prefix. A slice in parts along dimension 0 of a parameter with padding rows throws.
CheckpointPiece slice_piece(const ParamSpec& p);
// Local elements [begin, begin + count) of p (the distributed optimizer's piece of it): a flat
// slice of the global tensor when p's slice is one run of the flattened tensor (dimension 0 or
// whole), else a ranged slice (p's slice, the range of its storage): no gathering, whatever the
// slice. Clipped to the model's rows like slice_piece (the model rows are a prefix of the
// flattened tensor and of the local storage).
CheckpointPiece owned_piece(const ParamSpec& p, int64_t begin, int64_t count);

// A rank's place in the groups whose ranks hold identical copies of a parameter's slice.
struct HolderRanks {
  int dp_cp = 0, dp_cp_size = 1;      // dense parameters are replicated over dense data parallel
  int tp = 0, tp_size = 1;            // and, when not sharded, over the attention grid's TP group
  int expt_dp = 0, expt_dp_size = 1;  // expert parameters over expert data parallel
  int expt_tp = 0, expt_tp_size = 1;  // and, when not sharded, over expert TP
  int ep = 0;                         // which experts (the distinct expert slices)
  // The routers' state is the same on every rank of the pipeline stage that holds the layer
  // (tp x dp x cp: the whole world without pipeline parallelism).
  int world = 0, world_size = 1;
};
// Without the distributed optimizer: whether this rank writes its slice of p, the index-th
// parameter of the registry. The ranks that hold identical copies of a slice (the dense or
// expert data-parallel group, times the TP or expert TP group for a parameter replicated over
// it) take turns by parameter index (shifted by which distinct slice it is), so that each
// distinct slice is written exactly once and the writes spread evenly over the copies instead
// of all falling on data-parallel rank 0.
bool writes_slice(const ParamSpec& p, int index, const HolderRanks& r);
// With the distributed optimizer: each rank writes its own pieces of every parameter (the
// data-parallel group's pieces tile it); of a parameter replicated over TP, whose pieces every
// TP rank's group holds alike, the group of TP rank (index mod TP size) does.
bool writes_owned_pieces(const ParamSpec& p, int index, const HolderRanks& r);
// The routers' balancing state (the same on every rank): written by world rank (index mod the
// world size), index counting these tensors in order.
bool writes_replicated(int index, const HolderRanks& r);

}  // namespace moecore::train
