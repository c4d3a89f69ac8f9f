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

TpCommBytes plan_tp_comm(const ModelSpec& m, const RunSpec& run, const parallel::Degrees& d,
                         double tok) {
  TpCommBytes b;
  const int64_t global = run.global_batch > 0 ? run.global_batch : run.micro_batch * d.dp;
  const double n_micro =
      static_cast<double>(std::max<int64_t>(1, global / (run.micro_batch * d.dp)));
  const double T = static_cast<double>(m.seq_length * run.micro_batch) / d.cp;  // n
  const double H = static_cast<double>(m.hidden);
  const bool sp = run.parallel.sequence_parallel && d.tp > 1;
  const RecomputeModules rm = run.recompute.modules();
  const bool moe_rerun = run.recompute.selective() && rm.moe;
  const double ln = m.layernorm ? 2 : 1;  // a norm's parameters per feature (weight, bias)
  // Per micro-batch, summed over this rank's layers (all stages; / pp at the end).
  GroupBytes regions, expt, tpep;
  double partial_grads = 0;  // ReplicatedPartialGrad elements on the tp group
  double expert_grads = 0;        // ... on the expt_tp group
  if (d.tp > 1) {
    const double g = d.tp, f = (g - 1) / g;
    const double N = T * H * tok;  // one [n, H] activation
    // --bf16: the inputs of the attention's QKV projections, the dense MLPs' fc1 and the head
    // (bf16 GEMMs, which read the input's bf16 values) are all-gathered as bf16
    // (TensorParallel::enter with a staging buffer): 2 bytes also on the CPU. The gradients
    // (leave's backward all-gather, every reduce-scatter and all-reduce) keep the activations'
    // dtype: reduced in bf16 they would sum rounded partials.
    const double N_in = T * H * (run.bf16 ? 2.0 : tok);
    // The output gradient's all-gather (leave's backward, SP) is bf16 too where only the
    // row-parallel projection's bf16 GEMMs read it: without that projection's bias (whose
    // gradient sums the f32 values).
    const double dy_attn = run.bf16 && !m.add_attention_output_bias ? 2.0 : tok;  // B a value
    const double dy_mlp = run.bf16 && !m.add_mlp_bias ? 2.0 : tok;
    // A TP region's forward and its backward (enter + leave each way). With SP the backward
    // also gathers the region's input again (the gathered input is workspace, not kept: the
    // weight gradients of the column-parallel projection read it), as Megatron does.
    const auto region = [&](GroupBytes& x, double times, double dy) {
      if (sp) {
        // enter (fwd) and the regather; leave's backward
        x.all_gather += times * N_in * f + T * H * dy * f;
        x.reduce_scatter += times * N * f;  // leave (fwd) / enter's backward
      } else {
        x.all_reduce += times * 2 * N * f;  // leave (fwd) / enter's backward
      }
    };
    // The shared expert always runs sequence-parallel (the MoE layer's tokens are a slice); its
    // input's all-gathers bf16 under --bf16 too.
    const auto seq_region = [&](GroupBytes& x, double times) {
      x.all_gather += times * N_in * f + T * H * dy_mlp * f;
      x.reduce_scatter += times * N * f;
    };
    // Multi-latent attention (model/mla_attention.h): its latents enter the region instead of
    // x: q's (x itself without q LoRA), kv's and the raw rotary key, gathered each forward; the
    // backward gathers q's and kv's again (the raw rotary key too with mla_up_proj) and sends the
    // three gradients back; the output leaves as the QKV attention's does.
    const bool up_proj =
        run.recompute.selective() &&
        std::find(run.recompute_modules.begin(), run.recompute_modules.end(), "mla_up_proj") !=
            run.recompute_modules.end();
    // Under --bf16 q's and kv's latents (bf16 GEMMs' inputs) are gathered as bf16, the raw
    // rotary key (RoPE reads its f32 values) in the activations' dtype.
    const auto mla_region = [&](GroupBytes& x, double fwd) {
      const MlaSpec& s = *m.mla;
      const double q = s.q_lora_rank > 0 ? static_cast<double>(s.q_lora_rank) : H;
      const double lat = q + s.kv_lora_rank + s.qk_pos_emb_head_dim;  // per token
      const double qkv16 = (q + s.kv_lora_rank) * (run.bf16 ? 2.0 : tok);  // bytes per token
      const double pe = s.qk_pos_emb_head_dim * tok;
      const double t = T * f;
      if (sp) {
        // Each forward's gathers, the backward's regathers, leave's backward.
        x.all_gather += t * (fwd * (qkv16 + pe) + qkv16 + (up_proj ? pe : 0) + H * dy_attn);
        x.reduce_scatter += t * tok * (fwd * H + lat);
      } else {
        x.all_reduce += 2 * t * tok * (fwd * H + lat);
      }
    };
    for (int64_t l = 0; l < m.num_layers + m.mtp_num_layers; ++l) {
      const bool moe = m.is_moe_layer(std::min(l, m.num_layers - 1));
      const bool full = l < m.num_layers && run.recompute.chunk_of(l) >= 0;
      const double fwd = full ? 2 : 1;  // forwards of this layer per micro-batch
      if (m.mla)
        mla_region(regions, fwd);  // attention
      else
        region(regions, fwd + 1, dy_attn);  // attention
      if (!moe) {
        region(regions, fwd + 1 + (run.recompute.selective() && rm.mlp ? 1 : 0), dy_mlp);
      } else {
        if (!sp) {
          // The MoE output all-gathered over TP (fwd), its input gradient likewise (bwd).
          regions.all_gather += (fwd + 1) * N * f;
        }
        if (m.shared_ffn_hidden > 0) {
          seq_region(regions, fwd + 1 + (run.recompute.selective() && rm.shared_experts ? 1 : 0));
        }
      }
      // ReplicatedPartialGrad: norms under SP, q/k layernorm, the router, row-parallel biases;
      // under SP MLA's down projections and latent norms (whole on every rank without).
      if (sp) partial_grads += 2 * H * ln;
      if (m.qk_layernorm && !m.mla) partial_grads += 2.0 * m.kv_channels * ln;
      if (m.mla && sp) {
        const MlaSpec& s = *m.mla;
        const double norm = m.qk_layernorm ? 1 : 0;
        partial_grads += (H + norm) * (s.q_lora_rank + s.kv_lora_rank) + H * s.qk_pos_emb_head_dim;
      }
      if (moe) partial_grads += static_cast<double>(m.num_experts) * H;
      if (m.add_attention_output_bias) partial_grads += H;
      if (m.add_mlp_bias && (!moe || m.shared_ffn_hidden > 0)) partial_grads += H;
      if (l < m.num_layers) continue;
      // An MTP depth's eh_proj (model/mtp_layer.h): its output columns all-gathered onto the
      // tokens (fwd) and the output gradient gathered back (leave's backward, SP only); with SP
      // en and hn enter the region each way and their gradients are reduce-scattered,
      // all-reduced without SP (under --bf16 the gathers but the output's as bf16: only
      // eh_proj's bf16 GEMMs read them). Under SP its three norms' gradients are partial.
      regions.all_gather += N * f;
      if (sp) {
        regions.all_gather += 2 * 2 * N_in * f + N_in * f;
        regions.reduce_scatter += 2 * N * f;
        partial_grads += 3 * H * ln;
      } else {
        regions.all_reduce += 2 * 2 * N * f;
      }
    }
    if (sp) partial_grads += H * ln;  // the final norm
    // Vocab-parallel embedding (one leave) and head (one enter), once per micro-batch and MTP
    // module; the cross entropy's row maxima (T values of the activation dtype, all-reduced
    // with max) and its sums of exponentials and target logits (2 T f64 values, one all-reduce).
    const double heads = 1.0 + static_cast<double>(m.mtp_num_layers);
    if (sp) {
      b.tp_vocab.reduce_scatter = heads * 2 * N * f;  // embedding leave, head enter's backward
      b.tp_vocab.all_gather = heads * (N + N_in) * f;  // embedding leave's backward, head enter
      // With MTP every head's backward but the first gathers its input again
      // (GPTModel::head_backward: the depths' heads ran after it on the same buffers); the
      // first, the last depth's, finds its input still gathered.
      if (m.mtp_num_layers > 0) b.tp_vocab.all_gather += (heads - 1) * N_in * f;
    } else {
      b.tp_vocab.all_reduce = heads * 2 * 2 * N * f;  // embedding leave, head enter's backward
    }
    b.tp_vocab.all_reduce += heads * 2 * (T * tok + 2 * T * 8) * f;
    b.tp_vocab.all_gather *= n_micro;
    b.tp_vocab.reduce_scatter *= n_micro;
    b.tp_vocab.all_reduce *= n_micro;
    // fp32 gradients, all-reduced once per step; and the grad norm's dense sum of squares (one
    // f64) summed over tp.
    b.tp_grads.all_reduce = 2 * partial_grads * 4 * f + 2 * 8 * f;
  }
  if (m.num_experts > 0) {
    const double t = T / d.tp;  // the tokens of this rank's MoE layer (a sequence slice at tp > 1)
    const double K = static_cast<double>(m.topk), prob = tok;
    // --bf16: the gathers move the dispatched tokens as bf16 rows, and the output gradient too
    // without MLP biases; the reduce-scatters sum the experts' outputs and input gradients in the
    // activations' dtype (the alltoall dispatcher rounds the sums to bf16 after its ETP
    // reduce-scatter, before the all-to-all back).
    const double row_in = run.bf16 ? 2.0 : tok, row_dy = run.bf16 && !m.add_mlp_bias ? 2.0 : tok;
    int64_t moe_layers = 0, full_moe = 0;
    for (int64_t l = 0; l < m.num_layers; ++l) {
      if (!m.is_moe_layer(l)) continue;
      ++moe_layers;
      full_moe += run.recompute.chunk_of(l) >= 0;
    }
    moe_layers += m.mtp_num_layers;
    const double forwards = static_cast<double>(moe_layers + full_moe);  // per micro-batch
    const double dispatch_reruns = moe_rerun ? static_cast<double>(moe_layers) : 0;
    const double gtpep = static_cast<double>(d.etp) * d.ep;
    if (run.dispatcher == "allgather" && gtpep > 1) {
      // Over tp_ep: fwd all-gather of the (token count, slot count) meta (2 int64; dropless
      // only: padded, every rank's counts are known), the top-k indices (int32), the tokens and
      // the probs; reduce-scatter of the outputs. Bwd: all-gather of dy, reduce-scatter of dx and
      // dprobs. The moe module reruns the dispatch's gathers.
      const bool padded = run.pad_to_capacity && run.capacity_factor > 0;
      const double others = (gtpep - 1) * t;
      const double meta = padded ? 0 : (gtpep - 1) * 16;
      const double gather_fwd = meta + others * (K * 4 + H * row_in + K * prob);
      tpep.all_gather =
          (forwards + dispatch_reruns) * gather_fwd + moe_layers * others * H * row_dy;
      tpep.reduce_scatter =
          forwards * others * H * tok + moe_layers * others * (H * tok + K * prob);
    } else if (run.dispatcher == "alltoall" && gtpep > 1) {
      // Dropless: the token counts per expert (E int64) all-gathered over tp_ep, each forward
      // (padded dispatch has static splits and exchanges none).
      const bool padded = run.pad_to_capacity && run.capacity_factor > 0;
      if (!padded) tpep.all_gather = (forwards + dispatch_reruns) * (gtpep - 1) * m.num_experts * 8;
      if (d.etp > 1) {
        // After the EP all-to-all each ETP rank holds t K rows (balanced routing): all-gathered
        // with their probs over ETP (fwd), the experts' outputs reduce-scattered back; the
        // backward the reverse (all-gather of dy, reduce-scatter of dx and dprobs).
        const double rows = (d.etp - 1.0) * t * K;
        expt.all_gather = (forwards + dispatch_reruns) * rows * (H * row_in + prob) +
                          moe_layers * rows * H * row_dy;
        expt.reduce_scatter = forwards * rows * H * tok + moe_layers * rows * (H * tok + prob);
      }
    }
    if (d.etp > 1 && m.add_mlp_bias) {
      // The local experts' fc2 biases (row-parallel over ETP): ReplicatedPartialGrad.
      expert_grads = static_cast<double>(moe_layers) * (m.num_experts / d.ep) * H;
    }
  }
  const double pp = d.pp;
  const auto per_step = [&](GroupBytes x) {
    return GroupBytes{x.all_gather * n_micro / pp, x.reduce_scatter * n_micro / pp,
                      x.all_reduce * n_micro / pp};
  };
  b.tp_regions = per_step(regions);
  b.tp_vocab = GroupBytes{b.tp_vocab.all_gather / pp, b.tp_vocab.reduce_scatter / pp,
                          b.tp_vocab.all_reduce / pp};
  b.tp_grads.all_reduce /= pp;
  b.expt_tp = per_step(expt);
  if (d.etp > 1) b.expt_tp.all_reduce = 2 * expert_grads * 4 * (d.etp - 1.0) / d.etp / pp;
  b.tp_ep = per_step(tpep);
  return b;
}

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
    // What the EP dispatcher of one rank sends per MoE layer and micro-batch. Under --bf16 the
    // tokens travel as bf16 (the MoE layer casts them before the permutation), and so do the
    // expert outputs (combine) and the input gradients (the dispatch's backward), rounded once
    // where the experts' GEMMs wrote them, and the output gradient in the combine's backward
    // without MLP biases; otherwise the activations' dtype: f32 on the CPU backend, `dt` on a
    // GPU (Megatron's bf16 dataflow). The routing probs in fp32. Recomputation reruns the
    // dispatch: the "moe" module its forward dispatch (tokens + probs), full recomputation the
    // layer's whole forward.
    const double tok = hw.device == Device::CPU ? 4.0 : dt, prob = 4.0;
    const double tok_in = run.bf16 ? 2.0 : tok;
    const double tok_out = run.bf16 ? 2.0 : tok;
    const double tok_dy = run.bf16 && !m.add_mlp_bias ? 2.0 : tok;
    // Tokens entering this rank's router: its sequence slice at tp > 1 (with or without SP).
    const double t_rank = T / d.tp;
    double reruns = 0;  // forwards rerun per MoE layer, averaged over the layers
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
      const double dispatch = out * (H * tok_in + prob), combine = out * H * tok_out;
      const double combine_bwd = out * H * tok_dy, dispatch_bwd = out * (H * tok_out + prob);
      c.alltoall_bytes_per_layer_fwd = dispatch + combine;
      const double per_layer = dispatch + combine + combine_bwd + dispatch_bwd +
                               (moe_rerun ? dispatch : 0) + reruns * (dispatch + combine);
      c.alltoall_bytes_per_step = per_layer * per_micro;
      add("ep all-to-all (dispatch + combine, fwd + bwd)", parallel::GroupKind::Ep,
          c.alltoall_bytes_per_step, false,
          fmt::format("rows x (ep-1)/ep x (H x ({} + {} + {} + {}) B + 2 x 4 B probs){}{} x {:.1f} "
                      "MoE layers x {} micro-batches, rows = {}",
                      tok_in, tok_out, tok_dy, tok_out,
                      moe_rerun ? " + the moe module's rerun dispatch" : "",
                      reruns > 0 ? " + the recomputed layers' forward" : "", moe_layers, n_micro,
                      padded ? "E x capacity (padded)" : "T/tp x K"));
    }
  }
  // Tensor, sequence and expert-tensor parallelism (plan_tp_comm).
  const double tok = hw.device == Device::CPU ? 4.0 : dt;
  c.tp = plan_tp_comm(m, run, d, tok);
  const TpCommBytes& tb = c.tp;
  add(sp > 1 ? "tp all-gather + reduce-scatter of the TP regions (SP)"
             : "tp all-reduce of the TP regions",
      parallel::GroupKind::Tp, tb.tp_regions.total(), false,
      sp > 1 ? "per layer: attention, MLP / shared expert regions, each fwd + bwd: all-gather "
               "and reduce-scatter of T x H x dt, (tp-1)/tp of it sent"
             : "per layer: attention and MLP regions, each fwd + bwd: all-reduce of T x H x dt, "
               "2 (tp-1)/tp of it sent; the MoE layer's output and input gradient all-gathered; "
               "the shared expert sequence-parallel");
  add("tp vocab-parallel embedding, head and cross entropy", parallel::GroupKind::Tp,
      tb.tp_vocab.total(), false,
      "embedding leave + head enter, fwd + bwd, of T x H x dt; cross entropy: all-reduces of "
      "T row maxima (dt) and of 2 T f64 values (sums of exponentials, target logits)");
  add("tp all-reduce of partial-sum grads (norms under SP, router, row-parallel biases)",
      parallel::GroupKind::Tp, tb.tp_grads.total(), false,
      "2 (tp-1)/tp x their elements x 4 B, once per step");
  add("expt_tp all-gather + reduce-scatter of routed tokens (alltoall)",
      parallel::GroupKind::ExptTp, tb.expt_tp.total(), false,
      "per MoE layer fwd + bwd: (etp-1) x T/tp x K rows x (H x dt (+ prob)) each way; expert fc2 "
      "bias grads all-reduced");
  add(run.dispatcher == "allgather" ? "tp_ep all-gather + reduce-scatter (allgather dispatcher)"
                                    : "tp_ep all-gather of the token counts per expert",
      parallel::GroupKind::TpEp, tb.tp_ep.total(), false,
      run.dispatcher == "allgather"
          ? "(etp x ep - 1) x T/tp x (4 x H x dt + K x (8 B idx + 2 probs)) per MoE layer"
          : "(etp x ep - 1) x E x 8 B per MoE layer forward");
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
    // Each of a rank's chunks sends its output forward and its input's gradient backward for
    // every micro-batch, but the first virtual stage has no input to send back and the last no
    // output: a middle rank sends vp activations and vp gradients per micro-batch; the first
    // rank vp and vp - 1, the last vp - 1 and vp. Under --bf16 the activations (the residual
    // stream, bf16 values unless --fp32-residual-connection) move as bf16
    // (pipeline::ChunkBoundary), the gradients in the activations' dtype (f32 on the CPU). The
    // busiest rank's bytes; one activation per boundary (an MTP stage's boundaries are wider).
    const int vp = virtual_stages(m, run);
    const double act = run.bf16 && !run.fp32_residual_connection ? 2.0 : tok, grad = tok;
    const double A = T / sp * H * n_micro;  // elements of one boundary over the step
    const double acts = d.pp == 2 ? vp - 1.0 : vp, grads = vp;
    c.pp_first_stage_bytes_per_step = A * (vp * act + (vp - 1.0) * grad);
    // The shared word table's gradient (tied head on another stage): the first holder sends
    // its copy's (pipeline::PipelineRunner::exchange_tied_gradient), f32.
    if (m.tie_embeddings) c.pp_first_stage_bytes_per_step += m.vocab_size / d.tp * H * 4.0;
    add("pp send/recv of activations and their gradients", parallel::GroupKind::Pp,
        A * (acts * act + grads * grad), false,
        fmt::format("M x T/sp x H x ({} activations x {} B + {} gradients x {} B)", acts, act,
                    grads, grad));
  }
  return c;
}

}  // namespace moecore::plan
