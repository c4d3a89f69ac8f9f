// Validation of the parallel layout: every message names the numbers and the flag to change.
#include "parallel/parallel_config.h"

#include <CLI/CLI.hpp>
#include <numeric>
#include <tuple>

#include "core/check.h"
#include "parallel/context_split.h"
#include "parallel/pipeline_layout.h"

namespace moecore::parallel {

// --cp-comm-type: Megatron's four values, of which moecore builds p2p and allgather.
static void check_cp_comm_types(const ParallelConfig& cfg) {
  MOE_CHECK(!cfg.cp_comm_type.empty(), "[parallel] --cp-comm-type needs a value: p2p or allgather");
  for (const std::string& v : cfg.cp_comm_type) {
    MOE_CHECK(v != "a2a" && v != "a2a+p2p",
              "[parallel] --cp-comm-type {}: the all-to-all (Ulysses) forms of context "
              "parallelism are not built in moecore; use p2p (ring) or allgather",
              v);
    MOE_CHECK(v == "p2p" || v == "allgather" || v == "all_gather",
              "[parallel] --cp-comm-type {} is not one of p2p, allgather (Megatron also names "
              "a2a and a2a+p2p, which moecore does not build)",
              v);
  }
}

Degrees resolve_degrees(const ParallelConfig& cfg, int world_size) {
  MOE_CHECK(world_size >= 1 && world_size <= kMaxWorldSize,
            "[parallel] world size {} must be in [1, {}] (the largest layout moecore lays out)",
            world_size, kMaxWorldSize);
  auto positive = [](int v, const char* flag) {
    MOE_CHECK(v >= 1, "[parallel] {} {} must be >= 1", flag, v);
  };
  positive(cfg.tp, "--tensor-model-parallel-size");
  positive(cfg.pp, "--pipeline-model-parallel-size");
  positive(cfg.cp, "--context-parallel-size");
  positive(cfg.ep, "--expert-model-parallel-size");
  MOE_CHECK(cfg.etp >= 0,
            "[parallel] --expert-tensor-parallel-size {} must be >= 1 (or unset: same as "
            "--tensor-model-parallel-size)",
            cfg.etp);
  check_cp_comm_types(cfg);
  MOE_CHECK(cfg.timeout_minutes > 0,
            "[parallel] --distributed-timeout-minutes {} must be > 0 (a collective that waits "
            "longer reports the missing ranks and aborts)",
            cfg.timeout_minutes);

  Degrees d;
  d.world = world_size;
  d.tp = cfg.tp;
  d.cp = cfg.cp;
  d.pp = cfg.pp;
  d.etp = cfg.expert_tp();
  d.ep = cfg.ep;
  const int64_t attn_mp = int64_t{cfg.tp} * cfg.cp * cfg.pp;
  MOE_CHECK(world_size % attn_mp == 0,
            "[parallel] world size {} is not divisible by tp*cp*pp = {}*{}*{} = {}: the "
            "attention grid needs data-parallel size = world / (tp*cp*pp) to be whole; change "
            "--tensor-model-parallel-size, --context-parallel-size or "
            "--pipeline-model-parallel-size, or launch a multiple of {} ranks",
            world_size, cfg.tp, cfg.cp, cfg.pp, attn_mp, attn_mp);
  d.dp = static_cast<int>(world_size / attn_mp);
  const int64_t expt_mp = int64_t{d.etp} * d.ep * cfg.pp;
  MOE_CHECK(world_size % expt_mp == 0,
            "[parallel] world size {} is not divisible by etp*ep*pp = {}*{}*{} = {}: the expert "
            "grid (Parallel Folding) needs expert-data-parallel size = world / (etp*ep*pp) to be "
            "whole; change --expert-tensor-parallel-size (default: the TP size), "
            "--expert-model-parallel-size or --pipeline-model-parallel-size",
            world_size, d.etp, d.ep, cfg.pp, expt_mp);
  d.edp = static_cast<int>(world_size / expt_mp);
  // With pp not the slowest digit, a pipeline group strides over tp*cp ranks in the attention
  // grid and over etp*ep in the expert grid; they coincide only when both data-parallel sizes
  // are equal. Otherwise a stage would hold attention and experts of different layers.
  if (cfg.use_tp_pp_dp_mapping && cfg.pp > 1) {
    MOE_CHECK(d.dp == d.edp,
              "[parallel] --use-tp-pp-dp-mapping (order {}) with pp={} needs the attention and "
              "expert data-parallel sizes to be equal, got dp = world/(tp*cp*pp) = {} and "
              "edp = world/(etp*ep*pp) = {}: make tp*cp = etp*ep ({}*{} vs {}*{}) or drop "
              "--use-tp-pp-dp-mapping",
              cfg.order(), cfg.pp, d.dp, d.edp, cfg.tp, cfg.cp, d.etp, d.ep);
  }
  if (cfg.first_stage_layers != 0 || cfg.last_stage_layers != 0) {
    MOE_CHECK(cfg.first_stage_layers >= 0 && cfg.last_stage_layers >= 0,
              "[parallel] --decoder-first-pipeline-num-layers {} and "
              "--decoder-last-pipeline-num-layers {} must be >= 0",
              cfg.first_stage_layers, cfg.last_stage_layers);
    MOE_CHECK(cfg.pp > 1,
              "[parallel] --decoder-first/last-pipeline-num-layers set uneven pipeline stages but "
              "--pipeline-model-parallel-size is {}: set it > 1 or drop them",
              cfg.pp);
  }
  return d;
}

int stage_num_layers(const ParallelConfig& cfg, int num_layers, int stage, int64_t mtp_layers) {
  MOE_CHECK(stage >= 0 && stage < cfg.pp, "[parallel] pipeline stage {} outside [0, {})", stage,
            cfg.pp);
  const PipelineLayout layout = pipeline_layout(cfg, num_layers, mtp_layers);
  int64_t n = 0;
  for (int chunk = 0; chunk < layout.vp; ++chunk) n += layout.stage(stage, chunk).num_layers;
  return static_cast<int>(n);
}

Degrees validate_layout(const ParallelConfig& cfg, int world_size, const ModelDims& m) {
  Degrees d = resolve_degrees(cfg, world_size);

  for (const auto& [v, flag, least] :
       {std::tuple{m.num_layers, "--num-layers", 1}, std::tuple{m.num_experts, "--num-experts", 0},
        std::tuple{m.num_attention_heads, "--num-attention-heads", 1},
        std::tuple{m.num_query_groups, "--num-query-groups", 1},
        std::tuple{m.ffn_hidden, "--ffn-hidden-size", 1},
        std::tuple{m.moe_ffn_hidden, "--moe-ffn-hidden-size", 1},
        std::tuple{m.seq_length, "--seq-length", 1},
        std::tuple{m.shared_ffn_hidden, "--moe-shared-expert-intermediate-size", 0},
        std::tuple{m.vocab_size, "--vocab-size", 1}}) {
    MOE_CHECK(!v || *v >= least, "[parallel] {} {} must be >= {}", flag, *v, least);
  }
  if (m.num_experts) {
    const int64_t e = *m.num_experts;
    MOE_CHECK(e > 0 || cfg.ep == 1,
              "[parallel] --expert-model-parallel-size {} needs routed experts, but the model is "
              "dense (--num-experts {}): set --num-experts or use EP 1",
              cfg.ep, e);
    MOE_CHECK(e == 0 || e % cfg.ep == 0,
              "[parallel] --num-experts {} is not divisible by --expert-model-parallel-size {}: "
              "every EP rank holds E/EP experts; pick an EP that divides {} (or change the "
              "expert count)",
              e, cfg.ep, e);
  }
  // Every decoder layer on exactly one virtual stage, or an error naming the flags.
  if (m.num_layers) pipeline_layout(cfg, *m.num_layers, m.mtp_num_layers.value_or(0));
  // Megatron: with EP and TP together the MoE input must be sequence-parallel, so the
  // dispatcher sees each token once per TP group instead of TP duplicates.
  MOE_CHECK(!(cfg.tp > 1 && cfg.ep > 1) || cfg.sequence_parallel,
            "[parallel] attention TP {} with EP {} requires --sequence-parallel (each TP rank "
            "must route its own slice of the sequence, not a copy of the whole): add "
            "--sequence-parallel",
            cfg.tp, cfg.ep);
  if (m.num_attention_heads) {
    MOE_CHECK(*m.num_attention_heads % cfg.tp == 0,
              "[parallel] --num-attention-heads {} is not divisible by "
              "--tensor-model-parallel-size {}: each TP rank holds heads/TP heads",
              *m.num_attention_heads, cfg.tp);
  }
  if (m.num_query_groups) {
    MOE_CHECK(*m.num_query_groups % cfg.tp == 0,
              "[parallel] --num-query-groups {} is not divisible by --tensor-model-parallel-size "
              "{}: each TP rank holds groups/TP key-value heads",
              *m.num_query_groups, cfg.tp);
  }
  if (m.ffn_hidden) {
    MOE_CHECK(*m.ffn_hidden % cfg.tp == 0,
              "[parallel] --ffn-hidden-size {} is not divisible by --tensor-model-parallel-size "
              "{}",
              *m.ffn_hidden, cfg.tp);
  }
  if (m.shared_ffn_hidden && *m.shared_ffn_hidden > 0) {
    MOE_CHECK(*m.shared_ffn_hidden % cfg.tp == 0,
              "[parallel] --moe-shared-expert-intermediate-size {} is not divisible by "
              "--tensor-model-parallel-size {}: the shared experts split their width over TP; "
              "pick a multiple of {}",
              *m.shared_ffn_hidden, cfg.tp, cfg.tp);
  }
  if (m.vocab_size) {
    MOE_CHECK(*m.vocab_size % cfg.tp == 0,
              "[parallel] the padded vocabulary of {} entries is not divisible by "
              "--tensor-model-parallel-size {}: the embedding and the output head split it over "
              "TP; set --make-vocab-size-divisible-by to a multiple of {} (Megatron's default "
              "128 is one for TP sizes that divide 128)",
              *m.vocab_size, cfg.tp, cfg.tp);
  }
  if (m.moe_ffn_hidden && (!m.num_experts || *m.num_experts > 0)) {
    MOE_CHECK(*m.moe_ffn_hidden % d.etp == 0,
              "[parallel] --moe-ffn-hidden-size {} is not divisible by expert TP {} "
              "(--expert-tensor-parallel-size, default the TP size)",
              *m.moe_ffn_hidden, d.etp);
  }
  if (m.num_layers) {
    const size_t n = cfg.cp_comm_type.size();
    MOE_CHECK(n == 1 || static_cast<int64_t>(n) == *m.num_layers,
              "[parallel] --cp-comm-type has {} values for {} layers: give one value for every "
              "layer or one per decoder layer (--num-layers {})",
              n, *m.num_layers, *m.num_layers);
  }
  if (m.seq_length) {
    const int64_t s = *m.seq_length;
    // 2 cp chunks per sequence (Megatron's load-balanced split); its message names the fix.
    if (cfg.cp > 1) check_context_split(ContextSplit{s, cfg.cp, 0});
    if (cfg.sequence_parallel && cfg.tp > 1) {
      MOE_CHECK(s % (int64_t{cfg.tp} * cfg.cp) == 0,
                "[parallel] --seq-length {} is not divisible by tp*cp = {}*{}: "
                "--sequence-parallel splits each rank's sequence over TP",
                s, cfg.tp, cfg.cp);
    }
    // The transformer block lays out every TP > 1 layer for sequence slices (the MoE layer's
    // tokens, --sequence-parallel's activations) and requires S % TP == 0, dense models without
    // --sequence-parallel included: refused here, before any rank builds a model.
    MOE_CHECK(cfg.cp == 1 || s % (int64_t{cfg.tp} * cfg.cp) == 0,
              "[parallel] --seq-length {} is not divisible by tp*cp = {}*{}: each of the {} "
              "context-parallel ranks holds S/cp = {} positions, which the transformer block "
              "splits over the {} TP ranks by position; pick a --seq-length divisible by {}",
              s, cfg.tp, cfg.cp, cfg.cp, s / cfg.cp, cfg.tp, cfg.cp * std::lcm(2, cfg.tp));
    MOE_CHECK(s % cfg.tp == 0,
              "[parallel] --seq-length {} is not divisible by --tensor-model-parallel-size {}: "
              "with TP > 1 the transformer block splits each sequence over the TP ranks by "
              "position (the MoE layer's tokens, --sequence-parallel's activations); pick a "
              "--seq-length that is a multiple of {} or another TP size",
              s, cfg.tp, cfg.tp);
  }
  return d;
}

void add_parallel_flags(CLI::App& app, ParallelConfig& cfg) {
  const char* g = "Distributed";
  app.add_option("--tensor-model-parallel-size", cfg.tp, "Attention/dense tensor parallel size")
      ->group(g);
  app.add_option("--pipeline-model-parallel-size", cfg.pp, "Pipeline stages")->group(g);
  app.add_option("--context-parallel-size", cfg.cp, "Context (sequence) parallel size")
      ->group(g);
  app.add_option("--cp-comm-type", cfg.cp_comm_type,
                 "How attention reaches the other context-parallel ranks' keys and values: p2p "
                 "(ring) or allgather; one value, or one per decoder layer")
      ->group(g);
  app.add_option("--expert-model-parallel-size", cfg.ep, "Expert parallel size (EP)")->group(g);
  app.add_option("--expert-tensor-parallel-size", cfg.etp,
                 "Tensor parallel size inside experts (default: the TP size)")
      ->group(g);
  app.add_flag("--sequence-parallel", cfg.sequence_parallel,
               "Split activations outside TP regions along the sequence")
      ->group(g);
  app.add_flag("--use-tp-pp-dp-mapping", cfg.use_tp_pp_dp_mapping,
               "Rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp")
      ->group(g);
  app.add_option("--decoder-first-pipeline-num-layers", cfg.first_stage_layers,
                 "Layers on the first pipeline stage (uneven stages)")
      ->group(g);
  app.add_option("--decoder-last-pipeline-num-layers", cfg.last_stage_layers,
                 "Layers on the last pipeline stage (uneven stages)")
      ->group(g);
  app.add_option("--num-virtual-stages-per-pipeline-rank", cfg.vp_stages,
                 "Virtual pipeline stages per pipeline rank (interleaved schedule)")
      ->group(g);
  app.add_option("--num-layers-per-virtual-pipeline-stage", cfg.layers_per_vp_stage,
                 "Layers per virtual pipeline stage (sets the virtual stages per rank)")
      ->group(g);
  app.add_option("--microbatch-group-size-per-virtual-pipeline-stage", cfg.microbatch_group_size,
                 "Micro-batches a virtual stage runs in a row (default: the pipeline size)")
      ->group(g);
  app.add_flag("--account-for-embedding-in-pipeline-split", cfg.account_for_embedding,
               "The embedding counts as one layer of the first pipeline stage")
      ->group(g);
  app.add_flag("--account-for-loss-in-pipeline-split", cfg.account_for_loss,
               "The loss (final norm, head) counts as one layer of the last pipeline stage")
      ->group(g);
  app.add_option("--pipeline-model-parallel-layout", cfg.layout,
                 "Every virtual stage spelled out, e.g. \"E|(t|)*3,m|m||L\" (E embedding, t "
                 "decoder layer, m MTP layer, L loss)")
      ->group(g);
  app.add_option("--distributed-timeout-minutes", cfg.timeout_minutes,
                 "A collective waiting longer reports the missing ranks and aborts (moecore train: "
                 "whole minutes, Megatron's int)")
      ->group(g);
}

}  // namespace moecore::parallel
