#include "plan/plan.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "pipeline/schedule.h"
#include "train/trainer.h"

namespace moecore::plan {

void validate_run(const ModelSpec& m, const RunSpec& run, int world) {
  parallel::ModelDims dims;
  dims.num_layers = m.num_layers;
  dims.num_experts = m.num_experts;
  dims.num_attention_heads = m.num_heads;
  dims.num_query_groups = m.mla ? m.num_heads : m.num_query_groups;
  dims.ffn_hidden = m.ffn_hidden;
  if (m.num_experts > 0) dims.moe_ffn_hidden = m.moe_ffn_hidden;
  dims.seq_length = m.seq_length;
  dims.mtp_num_layers = m.mtp_num_layers;
  const parallel::Degrees d = parallel::validate_layout(run.parallel, world, dims);
  // The vocab-parallel embedding and output head hold vocab / tp rows each.
  MOE_CHECK(m.vocab_size % d.tp == 0,
            "[plan] the padded vocabulary {} is not divisible by --tensor-model-parallel-size {}: "
            "the embedding and output head split it over TP; pad it with "
            "--make-vocab-size-divisible-by (Megatron pads to a multiple of it x TP)",
            m.vocab_size, d.tp);
  const int64_t global = run.global_batch > 0 ? run.global_batch : run.micro_batch * d.dp;
  train::check_batch_split(global, run.micro_batch, d.dp);  // `moecore train`'s message
  // The placement was checked above (validate_layout runs pipeline_layout); every rank's schedule
  // must be one the trainer runs (the interleaved schedule's group size against M).
  for (int s = 0; s < d.pp; ++s) {
    pipeline::ScheduleConfig c;
    c.pp = d.pp;
    c.rank = s;
    c.vp = virtual_stages(m, run);
    c.num_microbatches = global / (run.micro_batch * d.dp);
    c.group_size = run.parallel.microbatch_group_size;
    pipeline::validate_schedule(c);
  }
  run.recompute.validate(m.num_layers);
}

Plan make_plan(const ModelSpec& m, const RunSpec& run, int world, const Hardware& hw,
               const ModelConfig* trainer_cfg) {
  Plan p;
  p.model = m;
  p.run = run;
  p.world = world;
  p.hw = hw;
  p.degrees = parallel::resolve_degrees(run.parallel, world);
  p.params = count_params(m);
  p.memory = plan_memory(m, run, world, hw, trainer_cfg);
  p.comm = plan_comm(m, run, world, hw);
  p.flops = plan_flops(m, run);
  p.roof = roofline(m, run, world, hw, p.flops, p.comm);
  p.fits = p.memory.max_total <= hw.memory_gib * 1024.0 * 1024 * 1024;
  bool from_arena = false;
  for (const StageMemory& s : p.memory.stages) from_arena = from_arena || s.from_arena;
  if (from_arena && trainer_cfg != nullptr && p.degrees.ep > 1 && m.num_experts > 0 &&
      trainer_cfg->moe.router.dropless() && trainer_cfg->moe.expert_rank_capacity_factor <= 0) {
    const int64_t balanced = run.micro_batch * m.seq_length * m.topk;
    p.notes.push_back(fmt::format(
        "dropless EP: the trainer plans every EP rank's dispatch and expert buffers for all the "
        "EP group's tokens on its experts (EP x T x K = {} rows per MoE layer, {}x the balanced "
        "load T x K = {}); --moe-expert-rank-capacity-factor F plans F x T x K rows instead (a "
        "step routing more to a rank stops with an error)",
        p.degrees.ep * balanced, p.degrees.ep, balanced));
  }
  return p;
}

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

std::string count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  return fmt::format("{:.0f}", n);
}

std::string bytes(double b) {
  if (std::abs(b) >= kGiB) return fmt::format("{:.2f} GiB", b / kGiB);
  return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
}

}  // namespace

std::string plan_text(const Plan& p) {
  const ModelSpec& m = p.model;
  const parallel::Degrees& d = p.degrees;
  std::string o;
  o += fmt::format("[plan] model {}: {} layers ({} MoE), hidden {}, {} heads{}, vocab {}{}\n",
                   m.name.empty() ? "(flags)" : m.name, m.num_layers, m.num_moe_layers(),
                   m.hidden, m.num_heads,
                   m.mla ? fmt::format(" (MLA: q_lora {}, kv_lora {}, qk {}+{}, v {})",
                                       m.mla->q_lora_rank, m.mla->kv_lora_rank,
                                       m.mla->qk_head_dim, m.mla->qk_pos_emb_head_dim,
                                       m.mla->v_head_dim)
                         : fmt::format(" / {} query groups x {}", m.num_query_groups,
                                       m.kv_channels),
                   m.vocab_size,
                   m.num_experts > 0 ? fmt::format(", {} experts top-{} (F {}, shared {})",
                                                   m.num_experts, m.topk, m.moe_ffn_hidden,
                                                   m.shared_ffn_hidden)
                                     : std::string());
  o += fmt::format("[plan] layout: {} GPUs ({} per node, {}): tp {} cp {} dp {} pp {} vpp {} | "
                   "etp {} ep {} edp {}{}{}; micro-batch {}, global batch {}, seq {}, {}\n",
                   p.world, p.hw.gpus_per_node, p.hw.name, d.tp, d.cp, d.dp, d.pp, virtual_stages(m, p.run),
                   d.etp, d.ep, d.edp, p.run.parallel.sequence_parallel ? ", SP" : "",
                   p.run.distributed_optimizer ? ", distributed optimizer" : "",
                   p.run.micro_batch,
                   p.run.global_batch > 0 ? p.run.global_batch : p.run.micro_batch * d.dp,
                   m.seq_length, p.run.bf16 ? "bf16" : "fp32");
  const ParamCounts& c = p.params;
  o += fmt::format("[plan] parameters: total {} ({} with MTP), active per token {} ({} with "
                   "MTP); embedding {}, head {}, dense decoder {}, experts {}\n",
                   count(c.total()), count(c.total_with_mtp()), count(c.active()),
                   count(c.active_with_mtp()), count(c.embedding), count(c.head),
                   count(c.decoder_dense), count(c.decoder_experts));
  for (const StageMemory& s : p.memory.stages) {
    std::string layers;
    for (const parallel::VirtualStage& v : s.chunks) {
      if (!layers.empty()) layers += ", ";
      layers += v.num_layers > 0 ? fmt::format("{}..{}", v.first_layer,
                                               v.first_layer + v.num_layers - 1)
                                 : std::string("none");
    }
    o += fmt::format("[plan] stage {} (layers {}{}{}{}): per rank params dense {}, expert {}, "
                     "embedding {}, head {}; memory from {}\n",
                     s.stage, layers,
                     s.has_embedding ? ", embedding" : "", s.has_head ? ", head" : "",
                     s.has_mtp ? ", MTP" : "",
                     count(s.params_dense), count(s.params_expert), count(s.params_embedding),
                     count(s.params_head),
                     s.from_arena ? "the trainer's planning pass (+ formula lines)"
                                  : fmt::format("formulas ({})", s.why_formula));
    for (const MemLine& l : s.lines) {
      o += fmt::format("         {:<12} {:>12}  {}{}\n", mem_part_name(l.part), bytes(l.bytes),
                       l.what, l.formula.empty() ? " [arena]" : " [formula: " + l.formula + "]");
    }
    if (s.from_arena) {
      o += fmt::format("         arena planned {} after sharing per-layer buffers (saves {})\n",
                       bytes(s.arena_planned), bytes(s.sharing_saves));
    }
    if (d.pp > 1) {
      std::string in_flight;
      for (int64_t n : s.in_flight) {
        if (!in_flight.empty()) in_flight += ' ';
        in_flight += std::to_string(n);
      }
      o += fmt::format("         schedule: {} warm-up forwards, micro-batches in flight per chunk "
                       "[{}], {} forwards recomputed before their backward; Megatron's schedule "
                       "would keep {:.2f} layer x micro-batch activations (informational){}\n",
                       s.warmup_forwards, in_flight, s.recomputed_forwards, s.in_flight_layers,
                       s.from_arena ? "" : " [the formula lines above use it]");
    }
    o += fmt::format("         total {} of {:.0f} GiB{}\n", bytes(s.total), p.hw.memory_gib,
                     s.total <= p.hw.memory_gib * kGiB ? "" : "  DOES NOT FIT");
    if (s.stage == 0) {
      o += fmt::format("         activations per layer per micro-batch (formula): {} = {}\n",
                       bytes(s.act_layer_bytes), s.act_formula);
    }
  }
  o += fmt::format("[plan] communication per step per rank:\n");
  for (const CommItem& it : p.comm.items) {
    o += fmt::format("         {:<52} {:>12} on {:<8} {:>9.2f} ms{}  [{}]\n", it.name,
                     bytes(it.bytes), it.internode ? "network" : "NVLink", it.seconds * 1e3,
                     it.overlapped ? " (overlapped)" : "", it.formula);
  }
  if (p.comm.alltoall_bytes_per_layer_fwd > 0) {
    o += fmt::format("         all-to-all per MoE layer per micro-batch forward: {} (rows x "
                     "(ep-1)/ep x (2 x H x dt + 4 B))\n",
                     bytes(p.comm.alltoall_bytes_per_layer_fwd));
  }
  o += fmt::format("[plan] FLOPs per token: 6 x {} active matmul params + 3 x {:.3g} attention "
                   "= {:.4g} (recomputation adds {:.3g})\n",
                   count(p.flops.active_matmul_params), p.flops.attention_flops_per_token,
                   p.flops.train_flops_per_token(), p.flops.recompute_flops_per_token);
  const Roofline& r = p.roof;
  o += fmt::format("[plan] roofline on {} ({:.0f} TFLOP/s peak): step {:.3f} s = (compute {:.3f} "
                   "+ pipeline recompute {:.3f} + exposed comm {:.3f}) x (1 + bubble {:.3f}) + dp "
                   "{:.3f}; {:.0f} tokens/s, {:.0f} TFLOP/s per GPU, MFU {:.1f}%\n",
                   p.hw.name, p.run.bf16 ? p.hw.peak_tflops_bf16 : p.hw.peak_tflops_fp32,
                   r.step_seconds, r.compute_seconds, r.pipeline_recompute_seconds,
                   r.exposed_comm_seconds, r.bubble_fraction,
                   r.dp_exposed_seconds, r.tokens_per_second, r.tflops_per_gpu, 100 * r.mfu);
  if (d.pp > 1) {
    o += fmt::format("[plan] pipeline: bubble (pp - 1) / (vp x M) = ({} - 1) / ({} x {}) = {:.3f} "
                     "of the step; the runner recomputes {} forwards of one micro-batch through "
                     "one chunk on its busiest stage ({:.3f} s; it keeps each in-flight "
                     "micro-batch's input, not its activations)\n",
                     d.pp, virtual_stages(m, p.run),
                     p.memory.stages.empty() ? 0 : p.memory.stages[0].num_microbatches,
                     r.bubble_fraction, r.recomputed_forwards, r.pipeline_recompute_seconds);
  }
  for (const std::string& note : p.notes) o += "[plan] note: " + note + "\n";
  o += fmt::format("[plan] {} (worst stage {}: {} of {:.0f} GiB)\n",
                   p.fits ? "fits" : "does NOT fit", p.memory.worst_stage,
                   bytes(p.memory.max_total), p.hw.memory_gib);
  return o;
}

std::string plan_json(const Plan& p) {
  using J = nlohmann::ordered_json;
  const ParamCounts& c = p.params;
  J j;
  j["params_total"] = c.total();
  j["params_total_with_mtp"] = c.total_with_mtp();
  j["params_active"] = c.active();
  j["params_active_with_mtp"] = c.active_with_mtp();
  j["params_embedding"] = c.embedding;
  j["params_head"] = c.head;
  j["params_experts"] = c.experts();
  const parallel::Degrees& d = p.degrees;
  j["layout"] = {{"world", p.world}, {"tp", d.tp}, {"cp", d.cp}, {"dp", d.dp}, {"pp", d.pp},
                 {"vpp", virtual_stages(p.model, p.run)}, {"ep", d.ep}, {"etp", d.etp}, {"edp", d.edp},
                 {"sequence_parallel", p.run.parallel.sequence_parallel},
                 {"distributed_optimizer", p.run.distributed_optimizer}};
  J stages = J::array();
  const StageMemory& worst = p.memory.stages[p.memory.worst_stage];
  auto mem_obj = [](const StageMemory& s) {
    J m;
    for (int k = 0; k < kNumMemParts; ++k) m[mem_part_name(static_cast<MemPart>(k))] = s.by_part[k];
    m["total"] = s.total;
    return m;
  };
  for (const StageMemory& s : p.memory.stages) {
    J st = {{"stage", s.stage},
            {"first_layer", s.first_layer},
            {"num_layers", s.num_layers},
            {"source", s.from_arena ? "arena" : "formula"},
            {"params_dense", s.params_dense},
            {"params_expert", s.params_expert},
            {"params_embedding", s.params_embedding},
            {"params_head", s.params_head},
            {"memory_bytes", mem_obj(s)}};
    if (p.degrees.pp > 1) {
      st["warmup_forwards"] = s.warmup_forwards;
      st["in_flight_per_chunk"] = s.in_flight;
      st["recomputed_forwards"] = s.recomputed_forwards;
      st["megatron_in_flight_layers"] = s.in_flight_layers;
    }
    if (s.from_arena) {
      st["pipeline_runner_bytes"] = s.pipeline_planned;
      st["arena_planned_bytes"] = s.arena_planned;
      st["sharing_saves_bytes"] = s.sharing_saves;
    }
    stages.push_back(st);
  }
  j["memory_per_rank_bytes"] = mem_obj(worst);
  j["memory_worst_stage"] = p.memory.worst_stage;
  j["stages"] = stages;
  j["fits"] = p.fits;
  j["device_memory_bytes"] = p.hw.memory_gib * kGiB;
  j["alltoall_bytes_per_step"] = p.comm.alltoall_bytes_per_step;
  j["alltoall_bytes_per_moe_layer_fwd"] = p.comm.alltoall_bytes_per_layer_fwd;
  // Per rank per step by collective form: what Communicator::bytes_sent() counts on each group.
  const auto forms = [](const GroupBytes& b) {
    return J{{"all_gather", b.all_gather}, {"reduce_scatter", b.reduce_scatter},
             {"all_reduce", b.all_reduce}};
  };
  j["tp_bytes_per_step"] = forms(p.comm.tp.tp());
  j["expt_tp_bytes_per_step"] = forms(p.comm.tp.expt_tp);
  j["tp_ep_bytes_per_step"] = forms(p.comm.tp.tp_ep);
  j["pp_first_stage_bytes_per_step"] = p.comm.pp_first_stage_bytes_per_step;
  J comm = J::array();
  for (const CommItem& it : p.comm.items) {
    comm.push_back({{"name", it.name}, {"group", it.group}, {"bytes", it.bytes},
                    {"link", it.internode ? "network" : "nvlink"}, {"seconds", it.seconds},
                    {"overlapped", it.overlapped}});
  }
  j["communication"] = comm;
  j["flops_per_token"] = p.flops.train_flops_per_token();
  j["active_matmul_params"] = p.flops.active_matmul_params;
  j["attention_flops_per_token"] = p.flops.attention_flops_per_token;
  j["recompute_flops_per_token"] = p.flops.recompute_flops_per_token;
  const Roofline& r = p.roof;
  j["hardware"] = p.hw.name;
  j["step_seconds"] = r.step_seconds;
  j["compute_seconds"] = r.compute_seconds;
  j["exposed_comm_seconds"] = r.exposed_comm_seconds;
  j["bubble_fraction"] = r.bubble_fraction;
  j["pipeline_recomputed_forwards"] = r.recomputed_forwards;
  j["pipeline_recompute_seconds"] = r.pipeline_recompute_seconds;
  j["tokens_per_second"] = r.tokens_per_second;
  j["tflops_per_gpu"] = r.tflops_per_gpu;
  j["mfu"] = r.mfu;
  j["notes"] = p.notes;
  return j.dump();
}

}  // namespace moecore::plan
