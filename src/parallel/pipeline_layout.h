// Where every decoder layer goes under pipeline parallelism: Megatron-Core's placement rules
// (even split, uneven first/last stages, virtual stages, the account-for flags, the layout
// string) as pure arithmetic on ParallelConfig, so a layout is checked before any rank builds a
// model and the model, the planner and `moecore groups` read one placement.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/parallel_config.h"

namespace moecore::parallel {

// One virtual pipeline stage: a contiguous run of decoder layers, and whether it holds the
// embedding (Megatron's pre_process) and the loss: final norm, output head, cross entropy (post_process).
struct VirtualStage {
  int64_t first_layer = 0;     // global index of its first decoder layer
  int64_t num_layers = 0;      // decoder layers ('t'); may be 0
  int64_t num_mtp_layers = 0;  // MTP layers ('m') of a layout string
  bool embedding = false;
  bool loss = false;
  // The MTP layers ran in an earlier virtual stage (Megatron's standalone MTP stage, e.g.
  // "...|m|L"): this stage receives, and passes on or takes the losses of, the decoder's hidden
  // states and every depth's concatenated, 1 + --mtp-num-layers boundary activations.
  bool mtp_before = false;
};

struct PipelineLayout {
  int pp = 1, vp = 1;
  std::vector<VirtualStage> stages;  // pp * vp; virtual stage i = chunk * pp + rank
  const VirtualStage& stage(int rank, int chunk) const { return stages[chunk * pp + rank]; }
  std::string describe() const;      // one line per virtual stage, for logs and `moecore groups`
};

// Where every decoder layer goes. Throws moecore::Error (MOE_CHECK) naming the flags and values
// when the layers cannot be placed exactly once (Megatron issues #1304 / #1778: never drop a
// layer or shrink the model silently).
// Without a layout string the MTP layers sit with the loss, in the last virtual stage.
PipelineLayout pipeline_layout(const ParallelConfig& cfg, int64_t num_layers, int64_t mtp_layers = 0);

// Megatron's embedding group: the pp ranks that hold the word-embedding table, in rank order:
// the embedding's, the MTP layers' (their depths embed the rolled ids) and, with a tied head, the
// loss's; empty when only the embedding reads it. The table's gradient is summed over them (pipeline/pipeline_runner.h). Megatron's
// default group is the first and last ranks only; a standalone MTP stage's copy is one more
// holder of the same table, so it belongs to the sum (else its copy drifts from the others).
std::vector<int> word_table_ranks(const PipelineLayout& layout, bool tie_embeddings);

// --pipeline-model-parallel-layout unrolled as Megatron's parse_str_to_list does it: commas
// dropped, "(...)*n" then "x*n" repeated, split at '|'. One string per virtual stage (in stage
// order i = chunk * pp + rank) of the letters E, t, m, L. Throws on any other character.
std::vector<std::string> parse_pipeline_layout(const std::string& layout);

}  // namespace moecore::parallel
