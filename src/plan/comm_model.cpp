#include "plan/comm_model.h"

#include <fmt/format.h>

#include <algorithm>

#include "moe/config.h"
#include "parallel/process_groups.h"
#include "plan/param_count.h"
#include "plan/sizing_groups.h"

namespace moecore::plan {
namespace {

// Whether the groups of kind k span more than one node (every group has the same shape).
bool spans_nodes(const parallel::Layout& layout, parallel::GroupKind k, int gpus_per_node) {
  for (const auto& g : layout.of(k)) {
    const int node = g.front() / gpus_per_node;
    for (int r : g) {
      if (r / gpus_per_node != node) return true;
    }
  }
  return false;
}

}  // namespace

CommPlan plan_comm(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw) {
  const parallel::Degrees d = parallel::resolve_degrees(run.parallel, world);
  const parallel::Layout& layout = planned_layout(run.parallel, world);
  const int64_t global = run.global_batch > 0 ? run.global_batch : run.micro_batch * d.dp;
  const double n_micro = std::max<int64_t>(1, global / (run.micro_batch * d.dp));
  const double dt = run.bf16 ? 2 : 4;
  const double T = static_cast<double>(m.seq_length * run.micro_batch) / d.cp;
  const double sp = run.parallel.sequence_parallel ? d.tp : 1;
  const double H = static_cast<double>(m.hidden);
  const double layers = static_cast<double>(m.num_layers + m.mtp_num_layers) / d.pp;
  const double moe_layers = static_cast<double>(m.num_moe_layers() + m.mtp_num_layers) / d.pp;
  CommPlan c;
  auto add = [&](std::string name, parallel::GroupKind g, double bytes, bool overlapped,
                 std::string formula) {
    if (bytes <= 0) return;
    CommItem it;
    it.name = std::move(name);
    it.group = std::string(parallel::group_name(g));
    it.bytes = bytes;
    it.internode = spans_nodes(layout, g, hw.gpus_per_node);
    it.seconds = bytes / ((it.internode ? hw.internode_gbps : hw.nvlink_gbps) * 1e9);
    it.overlapped = overlapped;
    it.formula = std::move(formula);
    (overlapped ? c.overlapped_seconds : c.exposed_seconds) += it.seconds;
    c.items.push_back(std::move(it));
  };
  if (m.num_experts > 0 && d.ep > 1) {
    // What the EP dispatcher of one rank sends per MoE layer and micro-batch. Token rows travel
    // in the activations' dtype (f32 on the CPU backend, whose activations are f32 also with
    // --bf16), the routing probs in fp32. Recomputation reruns the dispatch: the "moe" module
    // its forward dispatch (tokens + probs), full recomputation the layer's whole forward.
    const double tok = hw.device == Device::CPU ? 4.0 : dt, prob = 4.0;
    const double t_rank = T / sp;  // tokens entering this rank's router
    double reruns = 0;             // forwards rerun per MoE layer, averaged over the layers
    if (run.recompute.full()) {
      int64_t n = 0;
      for (int64_t l = 0; l < m.num_layers; ++l) n += m.is_moe_layer(l) && run.recompute.chunk_of(l) >= 0;
      reruns = m.num_moe_layers() > 0 ? static_cast<double>(n) / m.num_moe_layers() : 0;
    }
    const bool moe_rerun = run.recompute.selective() && run.recompute.modules().moe;
    const double per_micro = moe_layers * n_micro;
    if (run.dispatcher == "alltoall") {
      // Rows this rank dispatches: every kept (token, slot) dropless (T/sp x K), each expert's
      // capacity when padded (E x capacity, static); the share (ep-1)/ep leaves the rank, and
      // as many come back (exactly when padded, in expectation when dropless).
      const bool padded = run.pad_to_capacity && run.capacity_factor > 0;
      const double rows =
          padded ? static_cast<double>(m.num_experts *
                                       expert_capacity(static_cast<int64_t>(t_rank), m.topk,
                                                       m.num_experts, run.capacity_factor))
                 : t_rank * m.topk;
      const double out = rows * (d.ep - 1.0) / d.ep;
      const double dispatch = out * (H * tok + prob), combine = out * H * tok;
      c.alltoall_bytes_per_layer_fwd = dispatch + combine;
      const double per_layer = 2 * (dispatch + combine) + (moe_rerun ? dispatch : 0) +
                               reruns * (dispatch + combine);
      c.alltoall_bytes_per_step = per_layer * per_micro;
      add("ep all-to-all (dispatch + combine, fwd + bwd)", parallel::GroupKind::Ep,
          c.alltoall_bytes_per_step, false,
          fmt::format("rows x (ep-1)/ep x (4 x H x {} B + 2 x 4 B probs){}{} x {:.1f} MoE layers "
                      "x {} micro-batches, rows = {}",
                      tok, moe_rerun ? " + the moe module's rerun dispatch" : "",
                      reruns > 0 ? " + the recomputed layers' forward" : "", moe_layers, n_micro,
                      padded ? "E x capacity (padded)" : "T/sp x K"));
    } else {
      // allgather: every token (x, probs, routing map) goes to every other EP rank, and the
      // experts' partial sums of every rank's tokens come back in a reduce-scatter; the same
      // again in the backward (gather of dy, reduce-scatter of dx and dprobs).
      const double others = (d.ep - 1.0) * t_rank;
      const double fwd = others * (H * tok + m.topk * (prob + 4)) + others * H * tok;
      const double bwd = others * H * tok + others * (H * tok + m.topk * prob);
      const double per_layer =
          fwd + bwd + (moe_rerun ? others * (H * tok + m.topk * (prob + 4)) : 0) + reruns * fwd;
      add("ep all-gather + reduce-scatter (allgather dispatcher)", parallel::GroupKind::Ep,
          per_layer * per_micro, false,
          fmt::format("(ep-1) x T/sp x (4 x H x {} B + K x 16 B map and probs) per MoE layer, "
                      "x {:.1f} MoE layers x {} micro-batches",
                      tok, moe_layers, n_micro));
    }
  }
  if (d.tp > 1) {
    // Per layer: attention and MLP each an all-gather + reduce-scatter (SP) or an all-reduce,
    // forward and backward: 8 x (tp-1)/tp x T H dt sent per rank.
    add(run.parallel.sequence_parallel ? "tp all-gather + reduce-scatter (SP)" : "tp all-reduce",
        parallel::GroupKind::Tp, 8.0 * (d.tp - 1.0) / d.tp * T * H * dt * layers * n_micro, false,
        "8 x (tp-1)/tp x T x H x dt per layer per micro-batch");
  }
  if (d.etp > 1 && m.num_experts > 0) {
    add("expert-tp all-gather + reduce-scatter of routed tokens", parallel::GroupKind::ExptTp,
        4.0 * (d.etp - 1.0) / d.etp * T / sp * m.topk * H * dt * moe_layers * n_micro, false,
        "4 x (etp-1)/etp x T/sp x K x H x dt per MoE layer per micro-batch");
  }
  if (d.cp > 1) {
    const double kv = m.mla ? m.num_heads * (m.mla->qk_head_dim + m.mla->qk_pos_emb_head_dim +
                                             m.mla->v_head_dim)
                            : 2.0 * m.num_query_groups * m.kv_channels;
    add("cp key/value exchange", parallel::GroupKind::Cp,
        3.0 * (d.cp - 1.0) * T * kv / d.tp * dt * layers * n_micro, false,
        "3 x (cp-1) x T x kv width/tp x dt per layer per micro-batch (fwd K,V; bwd K,V and dK,dV)");
  }
  // Gradients: fp32 main grads over dp x cp (dense) and expert dp; the distributed optimizer
  // reduce-scatters them and all-gathers the updated bf16 parameters.
  const ParamCounts pc = count_params(m);
  const double dense = static_cast<double>(pc.total_with_mtp() - pc.experts() -
                                           m.mtp_num_layers * layer_params(m, true).experts) /
                       (d.tp * d.pp);
  const double experts = static_cast<double>(pc.experts() +
                                             m.mtp_num_layers * layer_params(m, true).experts) /
                         (d.ep * d.etp * d.pp);
  auto grads = [&](const char* name, parallel::GroupKind g, double params, int n) {
    if (n <= 1) return;
    const double f = (n - 1.0) / n;
    if (run.distributed_optimizer) {
      add(fmt::format("{} reduce-scatter + param all-gather", name), g,
          params * f * (4 + dt), true, "params x (n-1)/n x (4 B grads + dt params)");
    } else {
      add(fmt::format("{} all-reduce", name), g, params * 2 * f * 4, true,
          "params x 2 (n-1)/n x 4 B");
    }
  };
  grads("dense grads", parallel::GroupKind::DpCp, dense, d.dp * d.cp);
  grads("expert grads", parallel::GroupKind::ExptDp, experts, d.edp);
  if (d.pp > 1) {
    add("pp send/recv of activations and their gradients", parallel::GroupKind::Pp,
        2.0 * T / sp * H * dt * n_micro * run.vpp, false,
        "2 x T/sp x H x dt per micro-batch per virtual stage");
  }
  return c;
}

}  // namespace moecore::plan
