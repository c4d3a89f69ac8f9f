// FLOPs per token of one training step for a ModelSpec, the trainer's FLOPs model
// (train/metrics.h) extended to MLA and MTP:
//   6 * N_active + 3 * attention forward FLOPs
// N_active: matmul parameters a token passes through (attention projections, router, K routed
// experts, shared expert or dense MLP, output head; MTP: eh_proj, its layer and the head again).
// Attention forward per layer: Hq * (d_qk + d_v) * (S + 1) (Q K^T and P V over the causal
// context, (S + 1) / 2 keys on average); d_qk = d_v = D without MLA.
#pragma once

#include "plan/model_spec.h"

namespace moecore::plan {

struct PlanFlops {
  double active_matmul_params = 0;
  double attention_flops_per_token = 0;  // forward, all layers (MTP included)
  double train_flops_per_token() const {
    return 6.0 * active_matmul_params + 3.0 * attention_flops_per_token;
  }
  // Extra FLOPs of recomputation per token (not model FLOPs: MFU leaves them out).
  double recompute_flops_per_token = 0;
};

PlanFlops plan_flops(const ModelSpec& m, const RunSpec& run);

}  // namespace moecore::plan
