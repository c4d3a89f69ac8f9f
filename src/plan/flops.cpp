#include "plan/flops.h"

#include <algorithm>

#include "plan/param_count.h"

namespace moecore::plan {

PlanFlops plan_flops(const ModelSpec& m, const RunSpec& run) {
  PlanFlops f;
  const double S = static_cast<double>(m.seq_length);
  const double dqk = m.mla ? m.mla->qk_head_dim + m.mla->qk_pos_emb_head_dim : m.kv_channels;
  const double dv = m.mla ? m.mla->v_head_dim : m.kv_channels;
  const double attn_layer = static_cast<double>(m.num_heads) * (dqk + dv) * (S + 1);
  double full_layers = 0;  // layers whose forward reruns under full recomputation
  for (int64_t l = 0; l < m.num_layers; ++l) {
    f.active_matmul_params += static_cast<double>(layer_matmul_active(m, m.is_moe_layer(l)));
    f.attention_flops_per_token += attn_layer;
    if (run.recompute.chunk_of(l) >= 0) {
      full_layers += 1;
      f.recompute_flops_per_token +=
          2.0 * static_cast<double>(layer_matmul_active(m, m.is_moe_layer(l))) + attn_layer;
    }
  }
  const double head = static_cast<double>(m.hidden) * static_cast<double>(m.vocab_size);
  f.active_matmul_params += head;
  if (m.mtp_num_layers > 0) {
    const bool moe = m.is_moe_layer(m.num_layers - 1);
    const double H = static_cast<double>(m.hidden);
    f.active_matmul_params +=
        m.mtp_num_layers * (2 * H * H + static_cast<double>(layer_matmul_active(m, moe)) + head);
    f.attention_flops_per_token += m.mtp_num_layers * attn_layer;
  }
  // Selective recomputation reruns small pieces (the core attention when listed).
  if (run.recompute.selective() && run.recompute.modules().core_attn) {
    f.recompute_flops_per_token += f.attention_flops_per_token;
  }
  (void)full_layers;
  return f;
}

}  // namespace moecore::plan
