#include "plan/memory_model.h"

#include "ops/activation.h"
#include "ops/cuda/reduce_workspace.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "model/gpt_model.h"
#include "optim/optimizer.h"
#include "parallel/grad_buckets.h"
#include "parallel/pipeline_layout.h"
#include "parallel/process_groups.h"
#include "pipeline/pipeline_runner.h"
#include "plan/sizing_groups.h"

namespace moecore::plan {

const char* mem_part_name(MemPart p) {
  switch (p) {
    case MemPart::Weights: return "weights";
    case MemPart::Grads: return "grads";
    case MemPart::Optimizer: return "optimizer";
    case MemPart::Activations: return "activations";
    case MemPart::Recomputed: return "recomputed";
    case MemPart::State: return "state";
    case MemPart::Workspace: return "workspace";
    case MemPart::CommBuffers: return "comm_buffers";
    case MemPart::Reserved: return "reserved";
    case MemPart::Count: break;
  }
  return "?";
}

namespace {

// layout: the world's (null for one rank), built once per plan by the caller: a layout of many
// ranks takes longer to build than the pass itself.
// With pipeline parallelism the rank's model is its stage's chunks (pipeline_layout for its pp
// rank, as the trainer builds them), and the pipeline runner's buffers for the schedule of
// num_microbatches are sized by the runner's own count.
ArenaSizes arena_sizes_for(const ModelConfig& cfg, int64_t micro_batch,
                           const parallel::Layout* layout, int rank, Device device,
                           const parallel::GradReduceConfig& ddp, int64_t num_microbatches) {
  std::unique_ptr<parallel::ProcessGroups> groups;
  if (layout != nullptr) groups = sizing_groups(*layout, rank);
  std::vector<parallel::VirtualStage> chunks;
  pipeline::ScheduleConfig sched;
  if (groups != nullptr && groups->group(parallel::GroupKind::Pp).size() > 1) {
    const parallel::ParallelConfig& pc = groups->layout().config;
    const parallel::PipelineLayout pl =
        parallel::pipeline_layout(pc, cfg.num_layers, cfg.mtp_num_layers);
    sched.pp = pl.pp;
    sched.rank = groups->pp_stage();
    sched.vp = pl.vp;
    sched.num_microbatches = num_microbatches;
    sched.group_size = pc.microbatch_group_size;
    for (int c = 0; c < pl.vp; ++c) chunks.push_back(pl.stage(sched.rank, c));
  }
  Exec target;  // sizes only: no stream, no device needed
  target.device = device;
  const parallel::ProcessGroup* dense_group =
      groups ? &groups->group(parallel::GroupKind::DpCp) : nullptr;
  const parallel::ProcessGroup* expert_group =
      groups ? &groups->group(parallel::GroupKind::ExptDp) : nullptr;
  // As the trainer: --bf16 sharded keeps the fp32 master weights in the optimizer's shards.
  ModelConfig c = cfg;
  c.master_weights_sharded =
      c.bf16 && parallel::GradBuckets::shards(ddp, dense_group, expert_group);
  model::GPTModel<float> model(c, micro_batch, /*seed=*/0, groups.get(), /*size_only=*/true,
                               target, chunks);
  const Arena& a = model.arena();
  MOE_CHECK(!a.allocated(), "[plan] the sizing pass allocated its arena");
  // The ChainedOptimizer's two AdamWs: one over the dense, one over the expert parameters;
  // with the distributed optimizer over this rank's shards of the trainer's own gradient
  // buckets (the trainer's GradBuckets, built on the sizing groups: it allocates nothing).
  const ParamRegistry& p = model.params();
  int64_t owned[2] = {p.numel(ParamKind::Dense), p.numel(ParamKind::Expert)};
  ArenaSizes s;
  if (ddp.distributed_optimizer && groups != nullptr) {
    const parallel::GradBuckets buckets(p, model.grad_stages(), dense_group, expert_group, ddp);
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      const int i = static_cast<int>(k);
      s.shard_degree[i] = buckets.shard_degree(k);
      if (buckets.sharded()) owned[i] = buckets.owned_numel(k);
    }
  }
  const int64_t dense[2] = {owned[0], 0};
  const int64_t expert[2] = {0, owned[1]};
  Arena od, oe;
  DevPtr<float> m[2];
  DevPtr<float> v[2];
  DevPtr<float> w;
  const bool master = !p.holds_master();  // the optimizer's master weights: its owned elements
  od.size_only([&](Arena& x) { optim::adamw_state_layout(x, dense, m, v, master ? owned[0] : 0, &w); });
  oe.size_only([&](Arena& x) { optim::adamw_state_layout(x, expert, m, v, master ? owned[1] : 0, &w); });
  for (int k = 0; k < kNumMemKinds; ++k) {
    const MemKind kind = static_cast<MemKind>(k);
    s.by_kind[k] = static_cast<double>(a.bytes_of(kind) + od.bytes_of(kind) + oe.bytes_of(kind));
  }
  s.planned = static_cast<double>(a.planned_bytes() + od.planned_bytes() + oe.planned_bytes());
  s.recompute_saves = static_cast<double>(a.recompute_saving_bytes());
  s.sharing_saves = static_cast<double>(a.shared_saving_bytes()) - s.recompute_saves;
  s.numel_dense = p.numel(ParamKind::Dense);
  s.numel_expert = p.numel(ParamKind::Expert);
  s.numel_values32 = p.values32_numel(ParamKind::Dense) + p.values32_numel(ParamKind::Expert);
  s.master_in_optimizer = master;
  if (!chunks.empty()) {
    s.pipeline = pipeline::pipeline_buffer_sizes(sched, pipeline::chunk_boundaries(model),
                                                 pipeline::exchanged_table_elems(model, groups.get()));
    s.pipeline_planned = static_cast<double>(s.pipeline.bytes(sizeof(float)));
    s.boundary_elems = s.pipeline.boundary_elems;
  }
  return s;
}

}  // namespace

ArenaSizes trainer_arena_sizes(const ModelConfig& cfg, int64_t micro_batch,
                               const parallel::ParallelConfig& parallel, int world, int rank,
                               Device device, const parallel::GradReduceConfig& ddp,
                               int64_t num_microbatches) {
  if (world <= 1) {
    return arena_sizes_for(cfg, micro_batch, nullptr, rank, device, ddp, num_microbatches);
  }
  const parallel::Layout layout = parallel::make_layout(parallel, world);
  return arena_sizes_for(cfg, micro_batch, &layout, rank, device, ddp, num_microbatches);
}

namespace {

// Why the trainer's planning pass cannot size this rank (empty: it can).
std::string formula_reason(const ModelSpec& m, const RunSpec& r, const parallel::Degrees& d) {
  std::vector<std::string> why;
  // What the trainer does not build yet.
  if (r.fp8) why.push_back("FP8, not built by the trainer yet");
  if (r.main_grad_bytes != 4 || r.exp_avg_bytes != 4 || r.exp_avg_sq_bytes != 4 ||
      r.main_param_bytes != 4) {
    why.push_back("reduced-precision optimizer state, not built by the trainer yet");
  }
  if (!r.recompute_modules.empty() &&
      std::find(r.recompute_modules.begin(), r.recompute_modules.end(), "mla_up_proj") !=
          r.recompute_modules.end() && !m.mla) {
    why.push_back("mla_up_proj");
  }
  // TP / ETP: the trainer builds them; the formula is a choice: its parameters per rank equal
  // the trainer's sizing pass (tested), and that pass plans a dropless EP layout's worst-case
  // rows, which a published layout's balanced estimate does not assume.
  if (d.tp > 1 || d.etp > 1) {
    why.push_back(std::string(d.tp > 1 && d.etp > 1 ? "TP and ETP" : d.tp > 1 ? "TP" : "ETP") +
                  ": balanced routing, where the trainer's sizing pass plans the worst case");
  }
  std::string s;
  for (const std::string& w : why) s += (s.empty() ? "" : "; ") + w;
  return s;
}

// Activation bytes of one micro-batch of one decoder layer, Megatron's GPU accounting (flash
// attention: no score matrix), with the formula as text. T = s b / cp tokens on this rank, sp =
// tp with --sequence-parallel (else 1), dt = 2 (bf16) or 4 bytes.
double layer_activation_bytes(const ModelSpec& m, const RunSpec& r, const parallel::Degrees& d,
                              bool moe, std::string* formula) {
  const double T = static_cast<double>(m.seq_length * r.micro_batch) / d.cp;
  const double tp = d.tp, sp = r.parallel.sequence_parallel ? d.tp : 1, etp = d.etp;
  const double dt = r.bf16 ? 2 : 4;
  const double g8 = r.fp8 ? 1.0 / dt : 1.0;  // fp8: a linear layer's saved input takes 1 byte
  const double H = m.hidden, Hq = m.num_heads;
  const RecomputeModules rm = r.recompute.modules();
  const bool up_proj = std::find(r.recompute_modules.begin(), r.recompute_modules.end(),
                                 "mla_up_proj") != r.recompute_modules.end() &&
                       r.recompute.selective();
  std::string f;
  // Attention: the norm's input (the residual) and output, what the core keeps, its output.
  double attn = H / sp + (rm.layernorm ? 0 : H / sp);
  if (m.mla) {
    const MlaSpec& s = *m.mla;
    const double qk = s.qk_head_dim + s.qk_pos_emb_head_dim;
    const double latents = (s.q_lora_rank > 0 ? 2.0 * s.q_lora_rank : 0) +
                           2.0 * s.kv_lora_rank + s.qk_pos_emb_head_dim;
    attn += latents / sp + (up_proj ? 0 : Hq * (2 * qk + s.v_head_dim) / tp);
    f += fmt::format("attention(MLA) T*dt*(2H/sp + latents {:.0f}/sp{} + core out Hq*v/tp)", latents,
                     up_proj ? " [mla_up_proj recomputed]" : " + Hq*(2*qk+v)/tp");
    if (!rm.core_attn) attn += Hq * s.v_head_dim / tp;
  } else {
    const double D = m.kv_channels, Hkv = m.num_query_groups;
    attn += (Hq + 2 * Hkv) * D / tp + (rm.core_attn ? 0 : Hq * D / tp);
    f += fmt::format("attention T*dt*(H/sp{} + (Hq+2Hkv)D/tp{})", rm.layernorm ? "" : " + H/sp",
                     rm.core_attn ? " [core_attn recomputed]" : " + Hq*D/tp");
  }
  double bytes = T * dt * attn + (rm.core_attn ? 0 : T * 4 * Hq / tp);  // + fp32 softmax lse
  double ffn = H / sp + (rm.layernorm ? 0 : H / sp);
  if (moe) {
    // Router: fp32 logits / scores over E, top-k indices and probs. Dispatch: balanced routing
    // leaves T K rows per EP rank (all-gathered over ETP): fc1 input, fc1 output (2F/etp), the
    // activation (F/etp), and fc2's output kept for the probability-weighted unpermute.
    // The MoE layer's tokens are this rank's sequence slice T/tp whenever tp > 1 (with or
    // without SP: without it the block passes the slice and all-gathers the output).
    const double rows = T / tp * m.topk * etp;
    const double F = m.moe_ffn_hidden;
    const double F1 = static_cast<double>(ops::activation_fc1_width(m.activation, m.moe_ffn_hidden));
    const double Fs = m.shared_ffn_hidden;
    const double Fs1 = static_cast<double>(ops::activation_fc1_width(m.activation, m.shared_ffn_hidden));
    const double router = T / tp * (4.0 * 2 * m.num_experts + 12.0 * m.topk);
    double expert = rows * (H * g8 + F1 / etp + (rm.moe_act ? 0 : F / etp * g8) + H);
    double shared = m.shared_ffn_hidden > 0 ? (rm.shared_experts ? 0 : T * (Fs1 + Fs) / tp) : 0;
    if (rm.moe) expert = shared = 0;
    bytes += T * dt * ffn + router + dt * (expert + shared);
    // fc1's output is F1 = 2F wide for SwiGLU, F for the element-wise activations.
    const bool gated = ops::activation_gated(m.activation);
    f += fmt::format("; MoE T*dt*(H/sp{}) + router T/tp*(8E+12K) B + rows*dt*(2H + {}F/etp{}) with "
                     "rows = T/tp*K*etp (the permuted tokens, K x the layer's tokens){}{}{}",
                     rm.layernorm ? "" : " + H/sp", gated ? "2" : "", rm.moe_act ? "" : " + F/etp",
                     r.fp8 ? " [fp8: fc1 / fc2 inputs 1 B]" : "",
                     m.shared_ffn_hidden > 0 && !rm.shared_experts
                         ? (gated ? " + shared T*dt*3Fs/tp" : " + shared T*dt*2Fs/tp")
                         : "",
                     rm.moe ? " [moe recomputed: its input only]" : "");
  } else {
    const double F = m.ffn_hidden;
    const double F1 = static_cast<double>(ops::activation_fc1_width(m.activation, m.ffn_hidden));
    ffn += rm.mlp ? 0 : (F1 + F) / tp;
    bytes += T * dt * ffn;
    f += fmt::format("; MLP T*dt*(H/sp{}{})", rm.layernorm ? "" : " + H/sp",
                     rm.mlp                                    ? " [mlp recomputed]"
                     : ops::activation_gated(m.activation) ? " + 3F/tp"
                                                               : " + 2F/tp");
  }
  if (formula) *formula = f;
  return bytes;
}

// Layer x micro-batch activations held on `stage` at the peak of the schedule: 1F1B keeps
// pp - stage micro-batches; interleaving (vpp chunks) keeps (pp - stage - 1) * 2 + (vpp - 1) * pp
// + 1 chunks of L / (pp vpp) layers (Megatron's warm-up); never more than the step has.
double in_flight_layers(int pp, int vpp, int stage, int64_t layers_per_stage, int64_t n_micro) {
  if (pp == 1) return static_cast<double>(layers_per_stage);
  const double chunks = vpp > 1 ? (pp - stage - 1) * 2.0 + (vpp - 1.0) * pp + 1 : pp - stage;
  const double cap = static_cast<double>(n_micro) * vpp;
  return std::min(chunks, cap) * static_cast<double>(layers_per_stage) / vpp;
}

void add(StageMemory& s, MemPart part, double bytes, std::string what, std::string formula) {
  if (bytes == 0) return;
  s.lines.push_back(MemLine{part, bytes, std::move(what), std::move(formula)});
}

}  // namespace

MemoryPlan plan_memory(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw,
                       const ModelConfig* trainer_cfg) {
  const parallel::Degrees d = parallel::resolve_degrees(run.parallel, world);
  const parallel::Layout& layout = planned_layout(run.parallel, world);
  const int64_t global = run.global_batch > 0 ? run.global_batch : run.micro_batch * d.dp;
  const int64_t n_micro = std::max<int64_t>(1, global / (run.micro_batch * d.dp));
  const std::string reason = formula_reason(m, run, d);
  const double dense_shards = run.distributed_optimizer ? d.dp * d.cp : 1;
  const double expert_shards = run.distributed_optimizer ? d.edp : 1;
  const parallel::PipelineLayout pl =
      parallel::pipeline_layout(run.parallel, m.num_layers, m.mtp_num_layers);
  MemoryPlan plan;
  for (int s = 0; s < d.pp; ++s) {
    StageMemory st;
    st.stage = s;
    for (int c = 0; c < pl.vp; ++c) {
      const parallel::VirtualStage& v = pl.stage(s, c);
      st.chunks.push_back(v);
      st.num_layers += v.num_layers;
      st.has_embedding = st.has_embedding || v.embedding;
      st.has_head = st.has_head || v.loss;
      st.has_mtp = st.has_mtp || v.num_mtp_layers > 0;
    }
    st.first_layer = st.chunks.front().first_layer;
    st.num_microbatches = n_micro;
    // The stage's decoder layers, in global order (chunk by chunk).
    std::vector<int64_t> stage_layers;
    for (const parallel::VirtualStage& v : st.chunks) {
      for (int64_t l = v.first_layer; l < v.first_layer + v.num_layers; ++l) stage_layers.push_back(l);
    }
    if (d.pp > 1) {
      pipeline::ScheduleConfig sc;
      sc.pp = d.pp;
      sc.rank = s;
      sc.vp = pl.vp;
      sc.num_microbatches = n_micro;
      sc.group_size = run.parallel.microbatch_group_size;
      st.warmup_forwards = pipeline::warmup_forwards(sc);
      st.in_flight = pipeline::in_flight_per_chunk(sc);
      st.recomputed_forwards = pipeline::recomputed_forwards(sc);
    }
    // From a standalone MTP stage on the boundary carries every depth's hidden states after the
    // decoder's (Megatron's concatenation): 1 + D activations.
    bool wide = false, final_norm = false;
    for (const parallel::VirtualStage& v : st.chunks) {
      wide = wide || v.mtp_before || (v.num_mtp_layers > 0 && !v.loss);
      final_norm = final_norm || (m.mtp_num_layers > 0
                                      ? v.num_layers > 0 && v.first_layer + v.num_layers == m.num_layers
                                      : v.loss);
    }
    st.boundary_bytes = static_cast<double>(m.seq_length * run.micro_batch) / d.cp /
                        (run.parallel.sequence_parallel ? d.tp : 1) * m.hidden *
                        (run.bf16 ? 2 : 4) * (wide ? 1.0 + static_cast<double>(m.mtp_num_layers) : 1.0);
    // Parameters of one rank: dense parts split over TP but the replicated ones (norms, router,
    // row-parallel biases: LayerParams::tp_replicated), experts over EP x ETP but their fc2
    // biases (whole on every ETP rank); embedding and head vocab-parallel (/ tp), the learned
    // position table and the final norm whole.
    double dense = 0, experts = 0, dense_repl = 0, experts_repl = 0;
    for (int64_t l : stage_layers) {
      const LayerParams p = layer_params(m, m.is_moe_layer(l));
      dense += static_cast<double>(p.dense());
      experts += static_cast<double>(p.experts);
      dense_repl += static_cast<double>(p.tp_replicated);
      experts_repl += static_cast<double>(p.experts_etp_replicated);
    }
    const ParamCounts pc = count_params(m);
    if (st.has_mtp) {
      // The depths' layers (split as the decoder's), their norms (whole) and eh_proj (split).
      const LayerParams p = layer_params(m, m.is_moe_layer(m.num_layers - 1));
      const double depths = static_cast<double>(m.mtp_num_layers);
      dense += static_cast<double>(pc.mtp_total) - depths * static_cast<double>(p.experts);
      experts += depths * static_cast<double>(p.experts);
      dense_repl += depths * static_cast<double>(p.tp_replicated + 3 * pc.final_norm);
      experts_repl += depths * static_cast<double>(p.experts_etp_replicated);
    }
    const double emb = st.has_embedding ? static_cast<double>(pc.embedding) : 0;
    // A stage without the embedding keeps its own copy of the word table (split over TP) for a
    // tied head or for MTP; the final norm (whole) is the loss's, or with MTP the decoder's last
    // layer's.
    const bool table_copy =
        !st.has_embedding && ((st.has_head && m.tie_embeddings) || st.has_mtp);
    const double head_norm = final_norm ? static_cast<double>(pc.final_norm) : 0;
    const double head = (st.has_head ? static_cast<double>(pc.head) : 0) + head_norm +
                        (table_copy ? static_cast<double>(pc.embedding - pc.positions) : 0);
    const double positions = st.has_embedding ? static_cast<double>(pc.positions) : 0;
    st.params_dense = static_cast<int64_t>((dense - dense_repl) / d.tp + dense_repl);
    st.params_expert =
        static_cast<int64_t>(((experts - experts_repl) / d.etp + experts_repl) / d.ep);
    st.params_embedding = static_cast<int64_t>((emb - positions) / d.tp + positions);
    st.params_head = static_cast<int64_t>((head - head_norm) / d.tp + head_norm);
    const double dense_rank = static_cast<double>(st.params_dense + st.params_embedding +
                                                  st.params_head);
    const double expert_rank = static_cast<double>(st.params_expert);

    std::string act_f;
    double act_layer = 0, chunk_bytes = 0;
    const double T_rank = static_cast<double>(m.seq_length * run.micro_batch) / d.cp;
    const double sp_rank = run.parallel.sequence_parallel ? d.tp : 1;
    for (int64_t l : stage_layers) {
      const double full = layer_activation_bytes(m, run, d, m.is_moe_layer(l), &act_f);
      if (run.recompute.chunk_of(l) >= 0) {
        // Full recomputation keeps the layer's input only; its chunk is rebuilt, one at a time.
        act_layer += T_rank * (run.bf16 ? 2 : 4) * m.hidden / sp_rank;
        chunk_bytes = std::max(chunk_bytes, full * (run.recompute.method == RecomputeMethod::Uniform
                                                        ? run.recompute.num_layers
                                                        : 1));
      } else {
        act_layer += full;
      }
    }
    if (chunk_bytes > 0) act_f += "; full recomputation: T dt H/sp per recomputed layer";
    act_layer /= std::max<int64_t>(1, st.num_layers);
    st.act_layer_bytes = act_layer;
    st.act_formula = act_f;
    st.in_flight_layers = in_flight_layers(d.pp, pl.vp, s, st.num_layers, n_micro);

    if (reason.empty()) {
      // The trainer's own planning pass for the first rank of this stage.
      st.from_arena = true;
      const ModelConfig whole = trainer_cfg ? *trainer_cfg : trainer_model_config(m, run);
      const ModelConfig cfg = trainer_cfg ? *trainer_cfg : trainer_model_config(m, run);
      const int rank = layout.of(parallel::GroupKind::Pp)[0][s];
      parallel::GradReduceConfig ddp;
      ddp.distributed_optimizer = run.distributed_optimizer;
      ddp.bucket_size = run.ddp_bucket_size;
      const ArenaSizes a = arena_sizes_for(cfg, run.micro_batch, world > 1 ? &layout : nullptr,
                                           rank, hw.device, ddp, n_micro);
      st.arena_planned = a.planned + a.pipeline_planned;
      st.pipeline_planned = a.pipeline_planned;
      st.sharing_saves = a.sharing_saves;
      const MemPart parts[7] = {MemPart::Weights,     MemPart::Grads,      MemPart::Optimizer,
                                MemPart::Activations, MemPart::Recomputed, MemPart::State,
                                MemPart::Workspace};
      for (int k = 0; k < 7; ++k) {
        add(st, parts[k], a.by_kind[k], "trainer planning pass", "");
      }
      const double numel = static_cast<double>(a.numel_dense + a.numel_expert);
      if (a.pipeline_planned > 0) {
        // The pipeline runner's own arena: the kept inputs of the micro-batches in flight, and
        // the boundary buffers (sends in flight, the received gradient, the tied table's).
        const pipeline::PipelineBufferSizes& b = a.pipeline;
        pipeline::PipelineBufferSizes stash = b, rest = b;
        stash.grad_in_elems = stash.send_elems = stash.tied_elems = stash.send_slots_per_pool = 0;
        rest.stash_slots.assign(rest.stash_slots.size(), 0);
        rest.stash_elems = 0;
        std::string slots;
        for (int64_t n : b.stash_slots) slots += (slots.empty() ? "" : " + ") + std::to_string(n);
        add(st, MemPart::Activations, static_cast<double>(stash.bytes(sizeof(float))),
            fmt::format("pipeline stash: the inputs of the micro-batches in flight ({} per chunk)",
                        slots),
            "");
        add(st, MemPart::CommBuffers, static_cast<double>(rest.bytes(sizeof(float))),
            fmt::format("pipeline send pools (2 x {}), received gradient{}",
                        b.send_slots_per_pool, b.tied_elems > 0 ? ", the shared word table's gradient" : ""),
            "");
      }
      if (hw.device == Device::CPU && (d.dp * d.cp > 1 || d.edp > 1)) {
        // The CPU backend reduces gradient buckets with the MPI backend's ring (all-reduce, or
        // the distributed optimizer's reduce-scatter), whose scratch is one piece arriving and
        // one leaving per bucket in flight: 2/d of the bucket on every rank; the buckets of a
        // step are all in flight before the first wait. (Open MPI's own, MOECORE_MPI_REDUCTIONS=
        // libnbc, copied every bucket, and its reduce-scatter held two whole buckets on the
        // group's rank 0 from d = 3 on: bench/RESULTS.md.)
        const double gd = a.by_kind[1] * a.numel_dense / std::max(1.0, numel);
        const double ge = a.by_kind[1] - gd;
        const int64_t dense_d = d.dp * d.cp, expert_d = d.edp;
        const auto copies = [](int64_t group) { return group <= 1 ? 0.0 : 2.0 / group; };
        const auto name = [](int64_t group, const char* kind) {
          return group <= 1 ? std::string() : fmt::format("2/{} x {} grads", group, kind);
        };
        const std::string fd = name(dense_d, "dense"), fe = name(expert_d, "expert");
        add(st, MemPart::CommBuffers, copies(dense_d) * gd + copies(expert_d) * ge,
            run.distributed_optimizer
                ? "ring reduce-scatter scratch (two pieces of every bucket in flight)"
                : "ring all-reduce scratch (two pieces of every bucket in flight)",
            fd + (!fd.empty() && !fe.empty() ? " + " : "") + fe);
      }
      // The distributed optimizer needs no correction: the pass above sized the moments (and
      // under --bf16 the fp32 master weights) for this rank's shards of the trainer's buckets
      // (docs/parallel.md).
    } else {
      st.why_formula = reason;
      // Megatron's mixed precision: bf16 weights, fp32 main grads, fp32 master + Adam m, v
      // (6 + 12/d bytes per parameter); fp32 training: 4 + 4 + 8/d.
      const double wb = run.bf16 ? 2 : 4, gb = run.main_grad_bytes;
      const double ob = (run.bf16 ? run.main_param_bytes : 0) + run.exp_avg_bytes +
                        run.exp_avg_sq_bytes;
      add(st, MemPart::Weights, (dense_rank + expert_rank) * wb, "parameters",
          fmt::format("(dense {:.3g} + expert {:.3g}) x {} B", dense_rank, expert_rank, wb));
      add(st, MemPart::Grads, (dense_rank + expert_rank) * gb, "fp32 main grads",
          fmt::format("params x {} B", gb));
      add(st, MemPart::Optimizer, dense_rank * ob / dense_shards + expert_rank * ob / expert_shards,
          run.bf16 ? "master weights + Adam m, v" : "Adam m, v",
          fmt::format("dense x {}/{} + expert x {}/{} B", ob, dense_shards, ob, expert_shards));
      add(st, MemPart::Activations, act_layer * st.in_flight_layers,
          "activations in flight",
          fmt::format("{:.3g} B per layer-micro-batch x {:.2f} (1F1B{})", act_layer,
                      st.in_flight_layers, pl.vp > 1 ? " interleaved" : ""));
      const double T = static_cast<double>(m.seq_length * run.micro_batch) / d.cp;
      const double sp = run.parallel.sequence_parallel ? d.tp : 1;
      const double dt = run.bf16 ? 2 : 4;
      if (st.has_head) {
        add(st, MemPart::Activations, T * m.vocab_size / d.tp * 4.0, "output logits (fp32)",
            "T x V/tp x 4 B");
      }
      if (st.has_mtp) {
        add(st, MemPart::Activations, m.mtp_num_layers * (act_layer + T * 2 * m.hidden * dt / sp +
                                                          T * m.vocab_size / d.tp * 4.0),
            "MTP layers", "mtp x (a layer + T 2H/sp dt + T V/tp 4 B), per micro-batch");
      }
      if (d.cp > 1) {
        // Attention across the CP ranks (parallel::ContextParallelAttention's buffers), one layer
        // at a time: p2p keeps the ring's current and next K/V (and in the backward dK/dV
        // travelling with them); allgather the gathered K or V in rank order, K and V in global
        // order and one block's dK and dV (S rows of one of K, V: cp/2 blocks of T kv each).
        const double kv = m.mla ? m.num_heads * (m.mla->qk_head_dim + m.mla->qk_pos_emb_head_dim +
                                                 m.mla->v_head_dim)
                                : 2.0 * m.num_query_groups * m.kv_channels;
        bool gather = false;  // the largest of the layers' (one layer at a time)
        for (const std::string& t : run.parallel.cp_comm_type) gather |= t != "p2p";
        const double blocks = gather ? 2.5 * d.cp : 4.0;
        add(st, MemPart::CommBuffers, blocks * T * kv / d.tp * dt,
            gather ? "cp all-gathered K/V and their gradient (one layer at a time)"
                   : "cp ring K/V and dK/dV, current and next (one layer at a time)",
            gather ? "2.5 x cp x T x kv width/tp x dt" : "4 x T x kv width/tp x dt");
      }
      add(st, MemPart::Recomputed, chunk_bytes, "one recomputed chunk, rebuilt in the backward",
          "layers per chunk x a layer's activations");
      // One layer's backward scratch (gradients of its activations) at a time.
      add(st, MemPart::Workspace, act_layer, "one layer's backward gradients", "~ one layer's activations");
      if (m.num_experts > 0 && (d.ep > 1 || d.etp > 1)) {
        // The dispatcher's send rows and what its all-to-all receives (this rank's ETP slice:
        // T/tp x K rows under balanced routing), and with ETP > 1 the alltoall dispatcher's
        // slices of the whole ETP group gathered (etp times the receive side).
        const bool etp_gather = d.etp > 1 && run.dispatcher == "alltoall";
        const double gathered = etp_gather ? d.etp : 0;
        add(st, MemPart::CommBuffers, (2.0 + gathered) * T / d.tp * m.topk * m.hidden * dt,
            etp_gather ? "all-to-all send + receive buffers, ETP gather"
                       : "all-to-all send + receive buffers",
            etp_gather ? "(2 + etp) x T/tp x K x H x dt" : "2 x T/tp x K x H x dt");
      }
    }
    if (hw.device == Device::CUDA) {
      // The multi-block reductions' scratch (norms' weight gradients, the gradient norm):
      // one fixed block per stream that runs them, made on the stream's first reduction and
      // kept for the process, outside the arena; the trainer's ops run on one stream.
      add(st, MemPart::Workspace, static_cast<double>(ops::cuda::kReduceWorkspaceBytes),
          "reductions' scratch (one stream)",
          fmt::format("{} MiB per stream x 1", ops::cuda::kReduceWorkspaceBytes >> 20));
    }
    add(st, MemPart::Reserved, hw.reserved_gib * 1024.0 * 1024 * 1024,
        "CUDA context, library workspaces, NCCL buffers", fmt::format("{} GiB (estimate)",
                                                                      hw.reserved_gib));
    for (const MemLine& l : st.lines) st.by_part[static_cast<int>(l.part)] += l.bytes;
    st.total = 0;
    if (st.from_arena) {
      st.total = st.arena_planned;
      for (const MemLine& l : st.lines) {
        if (!l.formula.empty()) st.total += l.bytes;
      }
    } else {
      for (const MemLine& l : st.lines) st.total += l.bytes;
    }
    if (st.total > plan.max_total) {
      plan.max_total = st.total;
      plan.worst_stage = s;
    }
    plan.stages.push_back(std::move(st));
  }
  return plan;
}

}  // namespace moecore::plan
