// The parallel layout (Megatron-LM's degrees and flags) and its validation. Everything here is
// pure arithmetic on the degrees, so layouts can be checked with no processes launched
// (`moecore groups`) and every message is testable in one process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;  // <CLI/CLI.hpp> (heavy) in the .cpp files that build parsers
}  // namespace CLI

namespace moecore::parallel {

struct ParallelConfig {
  int tp = 1;   // --tensor-model-parallel-size (attention / dense layers)
  int pp = 1;   // --pipeline-model-parallel-size
  int cp = 1;   // --context-parallel-size
  // --cp-comm-type: one value for every layer or one per decoder layer (Megatron's list form);
  // p2p (ring) or allgather (Megatron's spelling; all_gather accepted too). a2a and a2a+p2p are
  // refused by validate_layout (not built). ContextParallel::attention reads a layer's.
  std::vector<std::string> cp_comm_type = {"p2p"};
  int ep = 1;   // --expert-model-parallel-size
  int etp = 0;  // --expert-tensor-parallel-size; 0: same as tp (Megatron's default)
  bool sequence_parallel = false;     // --sequence-parallel
  bool use_tp_pp_dp_mapping = false;  // --use-tp-pp-dp-mapping: order tp-cp-ep-pp-dp
  // Uneven pipeline stages (Megatron's --decoder-first/last-pipeline-num-layers); 0: even split.
  int first_stage_layers = 0;
  int last_stage_layers = 0;
  // Virtual pipeline stages (interleaved 1F1B); at most one of the three is set. 0: unset.
  int vp_stages = 0;            // --num-virtual-stages-per-pipeline-rank
  int layers_per_vp_stage = 0;  // --num-layers-per-virtual-pipeline-stage
  // --microbatch-group-size-per-virtual-pipeline-stage: micro-batches a virtual stage runs in a
  // row (forward and backward); 0: pp (Megatron's depth-first default).
  int microbatch_group_size = 0;
  // The embedding / the loss (final norm, head, cross entropy) count as one decoder layer of the
  // first / last stage when splitting (--account-for-embedding/loss-in-pipeline-split).
  bool account_for_embedding = false;
  bool account_for_loss = false;
  // --pipeline-model-parallel-layout: every virtual stage spelled out ("E|(t|)*3,m|m||L").
  std::string layout;
  // A blocking wait in any collective longer than this reports who is missing and aborts the
  // job. Megatron's --distributed-timeout-minutes (default 10); fractions allowed.
  double timeout_minutes = 10.0;

  int expert_tp() const { return etp > 0 ? etp : tp; }
  // The rank order string, fastest-varying first (Megatron's RankGenerator).
  std::string order() const { return use_tp_pp_dp_mapping ? "tp-cp-ep-pp-dp" : "tp-cp-ep-dp-pp"; }
  double timeout_seconds() const { return timeout_minutes * 60.0; }
  // Virtual pipeline stages per rank, from whichever flag sets them (1 when none does): the
  // layout's stage count / pp, --num-virtual-stages-per-pipeline-rank, or the layers of a rank /
  // --num-layers-per-virtual-pipeline-stage (which needs num_layers). Throws naming the flags
  // when more than one is given or they do not divide (pipeline_layout.cpp).
  int vp(int64_t num_layers) const;
  // Layer `layer`'s --cp-comm-type value (the list's entry, or the single value); the caller
  // has validated the list (validate_layout).
  const std::string& layer_cp_comm_type(int64_t layer) const {
    return cp_comm_type.size() == 1 ? cp_comm_type[0] : cp_comm_type[static_cast<size_t>(layer)];
  }
  // The micro-batch group of the interleaved schedule (0 resolved to pp).
  int microbatch_group() const { return microbatch_group_size > 0 ? microbatch_group_size : pp; }
};

// The degrees resolved against a world size: both grids of Parallel Folding.
struct Degrees {
  int world = 1;
  int tp = 1, cp = 1, dp = 1, pp = 1;  // attention grid: tp x cp x dp x pp = world
  int etp = 1, ep = 1, edp = 1;        // expert grid:    etp x ep x edp x pp = world
};

// Checks the degrees against the world size and returns both grids. Throws moecore::Error
// naming the numbers and the flag to change: non-positive degrees, world size not divisible by
// tp*cp*pp or by etp*ep*pp, ordering constraints of --use-tp-pp-dp-mapping, timeout <= 0.
Degrees resolve_degrees(const ParallelConfig& cfg, int world_size);

// What the layout must agree with in the model; unset fields are not checked (`moecore groups`
// may know only some of them).
// The largest world a layout is made for (2^17 = 131,072 ranks, beyond today's largest jobs):
// the group lists are O(world), `moecore groups` prints them all and `moecore plan --search`
// builds them for every candidate.
inline constexpr int kMaxWorldSize = 1 << 17;

struct ModelDims {
  std::optional<int64_t> num_layers;           // --num-layers
  std::optional<int64_t> num_experts;          // --num-experts (0: dense)
  std::optional<int64_t> num_attention_heads;  // --num-attention-heads
  std::optional<int64_t> num_query_groups;     // --num-query-groups (KV heads)
  std::optional<int64_t> ffn_hidden;           // --ffn-hidden-size
  std::optional<int64_t> moe_ffn_hidden;       // --moe-ffn-hidden-size
  std::optional<int64_t> seq_length;           // --seq-length
  std::optional<int64_t> shared_ffn_hidden;    // --moe-shared-expert-intermediate-size (0: none)
  std::optional<int64_t> vocab_size;           // the padded vocabulary
  std::optional<int64_t> mtp_num_layers;       // --mtp-num-layers (a layout string's m's)
};

// resolve_degrees plus the model-dependent rules: EP divides the expert count (and needs
// experts), every decoder layer placed on exactly one pipeline stage (pipeline_layout: even
// split, uneven first/last stages, virtual stages, account-for flags, a layout string),
// TP > 1 with EP > 1 needs --sequence-parallel, heads / query groups / ffn widths divisible by
// tp (etp for experts), the shared experts' width and the padded vocabulary divisible by tp,
// sequence length divisible by 2*cp (causal load balancing: check_context_split) and by tp*cp
// (each CP rank's S/cp positions split over TP by position: the MoE layer, sequence
// parallelism); --cp-comm-type's values (p2p, allgather; a2a and a2a+p2p refused) and its list
// length (1 or --num-layers).
Degrees validate_layout(const ParallelConfig& cfg, int world_size, const ModelDims& model);

// Decoder layers held by pipeline rank `stage`, all its virtual stages together: a sum over
// pipeline_layout (pipeline_layout.h), which validates the placement.
int stage_num_layers(const ParallelConfig& cfg, int num_layers, int stage, int64_t mtp_layers = 0);

// Binds the Megatron-LM flags above to `cfg` (group "Distributed"). The caller validates after
// parsing with validate_layout, once the world size and the model are known.
void add_parallel_flags(CLI::App& app, ParallelConfig& cfg);

}  // namespace moecore::parallel
