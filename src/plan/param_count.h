// Parameter counts of a ModelSpec, by part, Megatron's conventions: MLPs of the spec's
// activation (fc1 is 2F x H gated, F x H otherwise) with fc1 / fc2 biases when it has them,
// attention without linear biases (except --add-qkv-bias), RMSNorm weights counted, the MTP
// modules sharing the embedding and output layer with the main model (as Megatron builds them).
#pragma once

#include <cstdint>

#include "plan/model_spec.h"

namespace moecore::plan {

struct LayerParams {
  int64_t attention = 0;  // projections and their norms (q/kv layernorms of MLA, qk layernorm)
  int64_t norms = 0;      // input_layernorm + pre_mlp_layernorm
  int64_t dense_mlp = 0;  // dense layers (with their biases)
  int64_t router = 0;
  int64_t experts = 0;    // all E routed experts
  int64_t expert_one = 0; // one routed expert
  int64_t shared = 0;     // shared expert
  // What every TP rank holds whole (the rest of the dense parameters is split over TP): the
  // norms, q/k layernorm, the router and the row-parallel biases (attention output, fc2 of the
  // dense MLP and the shared expert). And the routed experts' fc2 biases, whole on every ETP
  // rank (the rest of the experts split over ETP).
  int64_t tp_replicated = 0;
  int64_t experts_etp_replicated = 0;
  int64_t dense() const { return attention + norms + dense_mlp + router + shared; }
  int64_t total() const { return dense() + experts; }
  int64_t active(int64_t topk) const { return dense() + topk * expert_one; }
};

struct ParamCounts {
  int64_t embedding = 0;  // V x H
  int64_t head = 0;       // V x H when untied, else 0
  int64_t final_norm = 0;
  int64_t positions = 0;  // the learned position table inside `embedding` (whole on every TP rank)
  int64_t decoder_dense = 0;    // all decoder layers, non-expert
  int64_t decoder_experts = 0;  // all decoder layers, routed experts
  int64_t decoder_active = 0;   // per token
  int64_t mtp_total = 0;        // the MTP modules (enorm, hnorm, eh_proj, a layer, final norm)
  int64_t mtp_active = 0;
  // The main model (what "671B" counts for DeepSeek-V3) and with the MTP modules.
  int64_t total() const { return embedding + head + final_norm + decoder_dense + decoder_experts; }
  int64_t total_with_mtp() const { return total() + mtp_total; }
  // Active per token: every dense parameter, K routed experts per MoE layer, embedding and head.
  int64_t active() const { return embedding + head + final_norm + decoder_active; }
  int64_t active_with_mtp() const { return active() + mtp_active; }
  int64_t experts() const { return decoder_experts; }
};

LayerParams layer_params(const ModelSpec& m, bool moe_layer);
ParamCounts count_params(const ModelSpec& m);

// Matmul parameters a token passes through in one decoder layer (attention projections, router,
// K experts, shared expert or dense MLP; not norms or biases): the FLOPs model's N_active per
// layer.
int64_t layer_matmul_active(const ModelSpec& m, bool moe_layer);

}  // namespace moecore::plan
