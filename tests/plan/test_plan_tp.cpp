// The planner under tensor, sequence and expert-tensor parallelism: the bytes each collective
// form sends over tp, expt_tp and tp_ep (plan_tp_comm) and the parameters of a rank, on small
// models hand-computed; the layout search's TP / SP / ETP candidates and the rules that refuse
// them; and the formula's parameters per rank against the trainer's sizing pass at TP 2 / ETP 2
// (which needs the TP layers: until they slice, that test says it was not run).
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "plan/comm_model.h"
#include "plan/layout_search.h"
#include "plan/memory_model.h"
#include "plan/plan.h"
#include "plan/sizing_groups.h"
#include "model/gpt_model.h"
#include "parallel/pipeline_layout.h"
#include "pipeline/pipeline_runner.h"

namespace moecore::plan {
namespace {

// 2 layers, H 8, 2 heads x D 4, seq 4, vocab 16, SwiGLU without biases, RMSNorm, tied embedding.
ModelSpec small(int64_t experts) {
  ModelSpec m;
  m.vocab_size = m.vocab_unpadded = 16;
  m.hidden = 8;
  m.num_layers = 2;
  m.num_heads = m.num_query_groups = 2;
  m.kv_channels = 4;
  m.ffn_hidden = 16;
  m.seq_length = m.max_position_embeddings = 4;
  m.num_experts = experts;
  m.moe_ffn_hidden = 8;
  m.topk = 2;
  return m;
}

RunSpec run_of(int tp, bool sp, int ep = 1, int etp = 1, const char* dispatcher = "allgather") {
  RunSpec r;
  r.parallel.tp = tp;
  r.parallel.sequence_parallel = sp;
  r.parallel.ep = ep;
  r.parallel.etp = etp;
  r.dispatcher = dispatcher;
  return r;
}

TpCommBytes tp_comm(const ModelSpec& m, const RunSpec& r, int world) {
  return plan_tp_comm(m, r, parallel::resolve_degrees(r.parallel, world), /*token_bytes=*/4);
}

// Below: n = 4 tokens, N = n H 4 B = 128 B, tp 2 ((tp-1)/tp = 1/2).
// Dense, no SP: per layer the attention and MLP regions each all-reduce N forward and backward
// (2 N (tp-1)/tp = 128 B each): 512 B a layer, 1024 B; the embedding's leave and the head's enter
// backward 2 x 128 B, the cross entropy's all-reduces of 4 row maxima (fp32) and 8 f64 sums 2 x (16 + 64) / 2 = 80 B;
// no partial-sum gradient (norms are replicated without SP); the grad norm's f64 sum over tp:
// 2 x 8 / 2 = 8 B.
TEST(PlanTpComm, DenseWithoutSequenceParallelIsAllReduces) {
  const TpCommBytes b = tp_comm(small(0), run_of(2, false), 2);
  EXPECT_EQ(b.tp_regions.all_reduce, 1024);
  EXPECT_EQ(b.tp_regions.all_gather + b.tp_regions.reduce_scatter, 0);
  EXPECT_EQ(b.tp_vocab.all_reduce, 256 + 80);
  EXPECT_EQ(b.tp_vocab.all_gather + b.tp_vocab.reduce_scatter, 0);
  EXPECT_EQ(b.tp_grads.total(), 8);
  EXPECT_EQ(b.tp().all_reduce, 1368);
  EXPECT_EQ(b.expt_tp.total() + b.tp_ep.total(), 0);
}

// Dense with SP: each region an all-gather and a reduce-scatter of N / 2 each way, and the
// backward's all-gather of the region's input again: 384 B of all-gather and 256 B of
// reduce-scatter a layer, 768 B and 512 B; embedding and head one of each way (128 B); the norms'
// gradients (2 x 8 a layer and the final 8: 40 fp32) all-reduced once: 2 x 160 / 2 = 160 B, and
// the grad norm's f64 sum 8 B.
TEST(PlanTpComm, DenseWithSequenceParallelIsGathersAndScatters) {
  const TpCommBytes b = tp_comm(small(0), run_of(2, true), 2);
  EXPECT_EQ(b.tp_regions.all_gather, 768);
  EXPECT_EQ(b.tp_regions.reduce_scatter, 512);
  EXPECT_EQ(b.tp_regions.all_reduce, 0);
  EXPECT_EQ(b.tp_vocab.all_gather, 128);
  EXPECT_EQ(b.tp_vocab.reduce_scatter, 128);
  EXPECT_EQ(b.tp_vocab.all_reduce, 80);
  EXPECT_EQ(b.tp_grads.all_reduce, 168);
  // Two micro-batches send twice the activations' bytes, the gradients' once.
  RunSpec two = run_of(2, true);
  two.global_batch = 2;
  const TpCommBytes b2 = tp_comm(small(0), two, 2);
  EXPECT_EQ(b2.tp_regions.all_gather, 1536);
  EXPECT_EQ(b2.tp_vocab.all_reduce, 160);
  EXPECT_EQ(b2.tp_grads.all_reduce, 168);
}

// MoE layers without SP (EP 1): the attention all-reduces (256 B a layer), the MoE output and its
// input gradient all-gathered (2 x 128 / 2 = 128 B a layer); the router's gradients (E H = 32 a
// layer) all-reduced: 2 x 64 x 4 / 2 = 256 B, and the grad norm's 8 B. A shared expert adds an
// all-gather and a reduce-scatter each way and the backward's gather of its input again (192 B of
// all-gather, 128 B of reduce-scatter a layer): it runs sequence-parallel.
TEST(PlanTpComm, MoeWithoutSequenceParallelGathersTheMoeOutput) {
  ModelSpec m = small(4);
  const TpCommBytes b = tp_comm(m, run_of(2, false), 2);
  EXPECT_EQ(b.tp_regions.all_reduce, 512);
  EXPECT_EQ(b.tp_regions.all_gather, 256);
  EXPECT_EQ(b.tp_regions.reduce_scatter, 0);
  EXPECT_EQ(b.tp_grads.all_reduce, 264);
  m.shared_ffn_hidden = 8;
  const TpCommBytes s = tp_comm(m, run_of(2, false), 2);
  EXPECT_EQ(s.tp_regions.all_gather, 256 + 384);
  EXPECT_EQ(s.tp_regions.reduce_scatter, 256);
  // Full recomputation reruns each layer's forward collectives.
  RunSpec full = run_of(2, false);
  full.recompute.granularity = RecomputeGranularity::Full;
  full.recompute.method = RecomputeMethod::Uniform;
  full.recompute.num_layers = 1;
  const TpCommBytes f = tp_comm(small(4), full, 2);
  EXPECT_EQ(f.tp_regions.all_reduce, 512 + 256);  // + the attention's forward all-reduce
  EXPECT_EQ(f.tp_regions.all_gather, 256 + 128);  // + the MoE output's gather
}

// ETP 2 x EP 2 on 4 ranks with TP 2 + SP: the MoE layer's t = n / tp = 2 tokens, K = 2.
// alltoall: after the all-to-all each ETP rank holds t K = 4 rows (balanced); (etp-1) t K = 4 rows
// sent: forward all-gather of rows with probs 4 x (32 + 4) and reduce-scatter of outputs 4 x 32,
// the backward the reverse: all-gather 2 x (144 + 128) = 544 B, reduce-scatter 544 B; dropless,
// the counts per expert (E = 4 int64) all-gathered over tp_ep (4 ranks): 2 x 3 x 32 = 192 B.
// allgather: over tp_ep (4 ranks) every other rank's 2 tokens: (4-1) x 16 B meta + 6 x (K 4 B idx +
// H 4 B + K 4 B probs) = 336 B forward a layer, + 6 x 32 backward: 2 x 336 + 2 x 192 = 1056 B;
// reduce-scatter 2 x 6 x 32 + 2 x 6 x (32 + 8) = 864 B.
TEST(PlanTpComm, ExpertTensorParallelDispatchers) {
  const ModelSpec m = small(4);
  const TpCommBytes a = tp_comm(m, run_of(2, true, 2, 2, "alltoall"), 4);
  EXPECT_EQ(a.expt_tp.all_gather, 544);
  EXPECT_EQ(a.expt_tp.reduce_scatter, 544);
  EXPECT_EQ(a.expt_tp.all_reduce, 0);  // no biases
  EXPECT_EQ(a.tp_ep.all_gather, 192);
  EXPECT_EQ(a.tp_ep.reduce_scatter, 0);
  const TpCommBytes g = tp_comm(m, run_of(2, true, 2, 2, "allgather"), 4);
  EXPECT_EQ(g.tp_ep.all_gather, 1056);
  EXPECT_EQ(g.tp_ep.reduce_scatter, 864);
  EXPECT_EQ(g.expt_tp.total(), 0);
  // Padded dispatch exchanges no counts.
  RunSpec padded = run_of(2, true, 2, 2, "alltoall");
  padded.capacity_factor = 1;
  padded.pad_to_capacity = true;
  EXPECT_EQ(tp_comm(m, padded, 4).tp_ep.all_gather, 0);
  // The allgather dispatcher padded: no meta (every rank's counts known), 1056 - 2 x 48 B.
  RunSpec padded_ag = run_of(2, true, 2, 2, "allgather");
  padded_ag.capacity_factor = 1;
  padded_ag.pad_to_capacity = true;
  EXPECT_EQ(tp_comm(m, padded_ag, 4).tp_ep.all_gather, 960);
  // The experts' fc2 biases (E / ep = 2 local experts x H a layer: 32 fp32) all-reduced over
  // ETP: 2 x 128 / 2 = 128 B.
  ModelSpec biased = m;
  biased.add_mlp_bias = true;
  EXPECT_EQ(tp_comm(biased, run_of(2, true, 2, 2, "alltoall"), 4).expt_tp.all_reduce, 128);
}

// --bf16 (the CPU backend's f32 activations, 4 B): the gathers move the tokens as bf16 (and dy
// without biases), the reduce-scatters the sums in f32. alltoall: forward all-gather 4 x (16 + 4),
// backward 4 x 16: 2 x (80 + 64) = 288 B; the reduce-scatter stays 544 B. With biases dy is
// gathered in f32: 2 x (80 + 128) = 416 B. allgather: forward 3 x 16 + 6 x (8 + 16 + 8) = 240 B,
// backward 6 x 16: 2 x 240 + 2 x 96 = 672 B, the reduce-scatter 864 B.
TEST(PlanTpComm, ExpertTensorParallelGathersUnderBf16) {
  const ModelSpec m = small(4);
  RunSpec a = run_of(2, true, 2, 2, "alltoall");
  a.bf16 = true;
  EXPECT_EQ(tp_comm(m, a, 4).expt_tp.all_gather, 288);
  EXPECT_EQ(tp_comm(m, a, 4).expt_tp.reduce_scatter, 544);
  ModelSpec biased = m;
  biased.add_mlp_bias = true;
  EXPECT_EQ(tp_comm(biased, a, 4).expt_tp.all_gather, 416);
  RunSpec g = run_of(2, true, 2, 2, "allgather");
  g.bf16 = true;
  EXPECT_EQ(tp_comm(m, g, 4).tp_ep.all_gather, 672);
  EXPECT_EQ(tp_comm(m, g, 4).tp_ep.reduce_scatter, 864);
}

// The EP all-to-all per step (alltoall dispatcher, EP 2 on 2 ranks, the CPU backend: f32
// activations): the MoE layer's n = 4 tokens x K 2 = 8 rows, half of them leave: 4 rows a phase.
// f32: each of the four phases moves 4 x 32 B of rows, the dispatch and its backward 4 x 4 B of
// probs: per layer 2 x (128 + 16) + 2 x 128 = 544 B, 1088 B for the 2 layers. --bf16: every
// phase's rows as bf16 (4 x 16 B): 2 x (64 + 16) + 2 x 64 = 288 B a layer, 576 B; with biases the
// combine's backward keeps f32 dy (4 x 32 B): 352 B a layer, 704 B.
TEST(PlanTpComm, EpAllToAllBytesUnderBf16) {
  const Hardware hw = hardware_preset("cpu");
  RunSpec r = run_of(1, false, 2, 1, "alltoall");
  EXPECT_EQ(make_plan(small(4), r, 2, hw).comm.alltoall_bytes_per_step, 1088);
  r.bf16 = true;
  EXPECT_EQ(make_plan(small(4), r, 2, hw).comm.alltoall_bytes_per_step, 576);
  ModelSpec biased = small(4);
  biased.add_mlp_bias = true;
  EXPECT_EQ(make_plan(biased, r, 2, hw).comm.alltoall_bytes_per_step, 704);
}

// The plan's communication lists them, over their groups.
TEST(PlanTpComm, PlanListsTheTpItems) {
  Hardware hw = hardware_preset("cpu");
  const Plan p = make_plan(small(4), run_of(2, true, 2, 2, "alltoall"), 4, hw);
  double tp = 0, expt_tp = 0, tp_ep = 0;
  for (const CommItem& it : p.comm.items) {
    if (it.group == "tp") tp += it.bytes;
    if (it.group == "expt_tp") expt_tp += it.bytes;
    if (it.group == "tp_ep") tp_ep += it.bytes;
  }
  EXPECT_EQ(tp, p.comm.tp.tp().total());
  EXPECT_EQ(expt_tp, 1088);
  EXPECT_EQ(tp_ep, 192);
  const auto j = nlohmann::json::parse(plan_json(p));
  EXPECT_EQ(j["tp_bytes_per_step"]["all_gather"].get<double>(), p.comm.tp.tp().all_gather);
  EXPECT_EQ(j["expt_tp_bytes_per_step"]["reduce_scatter"].get<double>(), 544);
}

// Parameters of one rank, hand-computed for small(4) with shared expert 8 and fc1 / fc2 biases:
// per layer attention QKV 3 x 8 x 8 = 192 + proj 64 (split), norms 16, router 32, shared expert
// fc1 16 x 8 + 16 bias, fc2 8 x 8 (split) + 8 bias (whole): dense 192 + 64 + 144 + 64 = 464 split,
// 16 + 32 + 8 = 56 whole: TP 2 holds 2 x (232 + 56) = 576. Experts: 4 x (fc1 128 + 16 + fc2 64,
// split over ETP; fc2 bias 8 whole) per layer: EP 2 x ETP 2: 2 x (4 x 208 / 2 + 32) / 2 = 448.
// Embedding 16 x 8 / 2 = 64; head: the final norm, 8, whole.
// The plan takes them from the formula (not from_arena); the trainer's sizing pass is held to the
// same counts by the test below.
TEST(PlanTpMemory, ParametersOfARankUnderTpAndEtp) {
  ModelSpec m = small(4);
  m.shared_ffn_hidden = 8;
  m.add_mlp_bias = true;
  const MemoryPlan mp =
      plan_memory(m, run_of(2, true, 2, 2, "alltoall"), 4, hardware_preset("cpu"));
  const StageMemory& s = mp.stages[0];
  EXPECT_FALSE(s.from_arena);
  EXPECT_EQ(s.params_dense, 576);
  EXPECT_EQ(s.params_expert, 448);
  EXPECT_EQ(s.params_embedding, 64);
  EXPECT_EQ(s.params_head, 8);
  // The dispatcher's buffers (n = 4 tokens, T/tp = 2 of them in the MoE layer, K 2, H 8, fp32):
  // send and receive 2 x 2 x 8 x 4 B = 128 B each, and the alltoall dispatcher's ETP gather of
  // both ETP ranks' received rows, 2 x 128 B: (2 + etp) x T/tp x K x H x dt = 512 B.
  const auto comm_buffers = [](const StageMemory& st) {
    return st.by_part[static_cast<int>(MemPart::CommBuffers)];
  };
  EXPECT_EQ(comm_buffers(s), 512);
  const MemoryPlan ag =
      plan_memory(m, run_of(2, true, 2, 2, "allgather"), 4, hardware_preset("cpu"));
  EXPECT_EQ(comm_buffers(ag.stages[0]), 256);
}

// The formula's parameters of a rank (above) against the trainer's own sizing pass of that rank
// (GPTModel on sizing groups), at TP 2 + SP and at ETP 2, for the model above with fc1 / fc2
// biases (the sizing pass must hold fewer parameters than one rank where TP or ETP > 1).
TEST(PlanTpMemory, FormulaParametersEqualTheSizingPassAtTp2AndEtp2) {
  ModelSpec m = small(4);
  m.shared_ffn_hidden = 8;
  m.add_mlp_bias = true;
  struct Case {
    const char* what;
    RunSpec run;
    int world;
  };
  const std::vector<Case> cases = {
      {"EP 2", run_of(1, false, 2, 1, "alltoall"), 2},
      {"TP 2 + SP", run_of(2, true), 2},
      {"ETP 2", run_of(1, false, 1, 2), 2},
      {"TP 2 + SP, EP 2, ETP 2", run_of(2, true, 2, 2, "alltoall"), 4}};
  const ModelConfig cfg = trainer_model_config(m, RunSpec{});
  const ArenaSizes one = trainer_arena_sizes(cfg, 1, {}, 1, 0);
  int compared = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    validate_run(m, c.run, c.world);
    const StageMemory s = plan_memory(m, c.run, c.world, hardware_preset("cpu")).stages[0];
    const ArenaSizes a = trainer_arena_sizes(cfg, 1, c.run.parallel, c.world, 0);
    const parallel::Degrees d = parallel::resolve_degrees(c.run.parallel, c.world);
    if (d.tp > 1) {
      EXPECT_LT(a.numel_dense, one.numel_dense) << "dense parameters not sliced";
    }
    if (d.etp > 1) {
      EXPECT_LT(a.numel_expert * d.ep, one.numel_expert) << "experts not sliced";
    }
    ++compared;
    EXPECT_EQ(s.params_dense + s.params_embedding + s.params_head, a.numel_dense);
    EXPECT_EQ(s.params_expert, a.numel_expert);
  }
  EXPECT_EQ(compared, static_cast<int>(cases.size()));
}

// The same with multi-latent attention (q LoRA and linear_q_proj, the latents' norms, linear_proj's
// bias): its down projections and norms whole on every TP rank, the up projections and
// linear_proj split over the heads; the formula's parameters of a rank, and the whole model's,
// equal the trainer's registry (one rank) and sizing pass (TP 2 with and without SP, with EP 2).
TEST(PlanTpMemory, MultiLatentAttentionParametersEqualTheTrainersAtTp2) {
  for (const int64_t q_lora : {6, 0}) {
    SCOPED_TRACE(q_lora > 0 ? "q LoRA" : "linear_q_proj");
    ModelSpec m = small(4);
    m.num_heads = m.num_query_groups = 4;
    m.shared_ffn_hidden = 8;
    m.qk_layernorm = true;
    m.add_attention_output_bias = true;
    m.mla = MlaSpec{q_lora, 5, 3, 2, 4};
    const ModelConfig cfg = trainer_model_config(m, RunSpec{});
    ASSERT_TRUE(cfg.multi_latent_attention);
    const ArenaSizes one = trainer_arena_sizes(cfg, 1, {}, 1, 0);
    EXPECT_EQ(one.numel_dense + one.numel_expert, count_params(m).total());
    struct Case {
      const char* what;
      RunSpec run;
      int world;
    };
    for (const Case& c : {Case{"TP 2", run_of(2, false), 2}, Case{"TP 2 + SP", run_of(2, true), 2},
                          Case{"TP 2 + SP, EP 2", run_of(2, true, 2, 1, "alltoall"), 4}}) {
      SCOPED_TRACE(c.what);
      validate_run(m, c.run, c.world);
      const StageMemory st = plan_memory(m, c.run, c.world, hardware_preset("cpu")).stages[0];
      const ArenaSizes a = trainer_arena_sizes(cfg, 1, c.run.parallel, c.world, 0);
      EXPECT_LT(a.numel_dense, one.numel_dense) << "dense parameters not sliced";
      EXPECT_EQ(st.params_dense + st.params_embedding + st.params_head, a.numel_dense);
      EXPECT_EQ(st.params_expert, a.numel_expert);
    }
  }
}

// Multi-token prediction (two MoE depths): the formula's parameters of every stage's rank equal
// the trainer's sizing pass of that rank, on one rank, under TP 2 + SP (eh_proj split, the depths'
// norms whole), and under PP 2 tied and untied (the last stage's copy of the word table: the tied
// head's, or the depths' own beside the untied head); the plan sizes them from the trainer's
// arena where nothing else asks for the formula.
TEST(PlanTpMemory, FormulaParametersEqualTheSizingPassWithMtp) {
  struct Case {
    const char* what;
    int tp, pp;
    bool tied;
  };
  const std::vector<Case> cases = {{"one rank", 1, 1, false},
                                   {"TP 2 + SP", 2, 1, true},
                                   {"PP 2 tied", 1, 2, true},
                                   {"PP 2 untied", 1, 2, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ModelSpec m = small(4);
    m.num_layers = 4;
    m.mtp_num_layers = 2;
    m.tie_embeddings = c.tied;
    RunSpec run = run_of(c.tp, c.tp > 1);
    run.parallel.pp = c.pp;
    const int world = c.tp * c.pp;
    validate_run(m, run, world);
    const MemoryPlan mp = plan_memory(m, run, world, hardware_preset("cpu"));
    const ModelConfig cfg = trainer_model_config(m, RunSpec{});
    EXPECT_EQ(cfg.mtp_num_layers, 2);
    ASSERT_EQ(mp.stages.size(), static_cast<size_t>(c.pp));
    for (int s = 0; s < c.pp; ++s) {
      const StageMemory& st = mp.stages[s];
      EXPECT_EQ(st.from_arena, c.tp == 1) << "stage " << s;
      EXPECT_EQ(st.has_mtp, s == c.pp - 1) << "stage " << s;
      // Stage s's first rank: pp is the slowest digit of the rank order.
      const ArenaSizes a = trainer_arena_sizes(cfg, 1, run.parallel, world, s * c.tp);
      EXPECT_EQ(st.params_dense + st.params_embedding + st.params_head, a.numel_dense)
          << "stage " << s;
      EXPECT_EQ(st.params_expert, a.numel_expert) << "stage " << s;
    }
  }
}

// A standalone MTP stage (Megatron's "...mm|L", two MoE depths, PP 3): the trainer's own
// planning pass sizes every stage (no formula fallback), the formula's parameters equal it (the
// MTP stage's copy of the word table, the final norm beside the decoder's last layer, a tied loss
// stage's copy), the boundary bytes are 1 + D activations from the MTP stage on, and the plan's
// pipeline buffers are what each stage's runner allocates: the MTP stage keeps 1-activation
// inputs but sends 3, the loss stage keeps 3-activation inputs.
TEST(PlanTpMemory, StandaloneMtpStageFromTheTrainersPass) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    ModelSpec m = small(4);
    m.num_layers = 4;
    m.mtp_num_layers = 2;
    m.tie_embeddings = tied;
    RunSpec run = run_of(1, false);
    run.parallel.pp = 3;
    run.parallel.layout = "Ett|ttmm|L";
    run.global_batch = 4;
    const int world = 3;
    validate_run(m, run, world);
    const MemoryPlan mp = plan_memory(m, run, world, hardware_preset("cpu"));
    const ModelConfig cfg = trainer_model_config(m, run);
    ASSERT_EQ(mp.stages.size(), 3u);
    const double activation = static_cast<double>(m.seq_length * run.micro_batch * m.hidden * 4);
    const parallel::Layout layout = parallel::make_layout(run.parallel, world);
    for (int s = 0; s < 3; ++s) {
      SCOPED_TRACE(testing::Message() << "stage " << s);
      const StageMemory& st = mp.stages[s];
      EXPECT_TRUE(st.from_arena) << st.why_formula;
      EXPECT_EQ(st.has_mtp, s == 1);
      EXPECT_EQ(st.boundary_bytes, (s == 0 ? 1 : 3) * activation);
      const ArenaSizes a = trainer_arena_sizes(cfg, run.micro_batch, run.parallel, world, s,
                                               Device::CPU, {}, st.num_microbatches);
      EXPECT_EQ(st.params_dense + st.params_embedding + st.params_head, a.numel_dense);
      EXPECT_EQ(st.params_expert, a.numel_expert);
      EXPECT_EQ(st.pipeline_planned, a.pipeline_planned);
      // The runner of this stage, built on the same sizing groups, plans those bytes.
      const auto groups = sizing_groups(layout, s);
      const parallel::PipelineLayout pl =
          parallel::pipeline_layout(run.parallel, m.num_layers, m.mtp_num_layers);
      model::GPTModel<float> model(cfg, run.micro_batch, 1, groups.get(), /*size_only=*/true,
                                   cpu_exec(), {pl.stage(s, 0)});
      const pipeline::PipelineRunner<float> runner(model, groups.get(), st.num_microbatches, 0,
                                                   cpu_exec());
      EXPECT_EQ(static_cast<double>(runner.planned_bytes()), a.pipeline_planned);
      const int64_t n = model.boundary_elems();
      EXPECT_EQ(a.pipeline.input_elems, std::vector<int64_t>{s == 2 ? 3 * n : n});
      EXPECT_EQ(a.pipeline.boundary_elems, s == 0 ? n : 3 * n);
      // The word table: the first stage's, the MTP stage's copy, a tied loss stage's copy.
      EXPECT_EQ(a.pipeline.tied_elems > 0, s < 2 || tied);
    }
  }
}

// The search tries TP with and without SP and ETP of every power of two dividing the expert
// width, and refuses what the rules refuse: SP missing with EP and TP, ETP not dividing the
// expert FFN width, query groups not divisible by TP.
TEST(PlanTpSearch, CandidatesAndTheirRules) {
  ModelSpec m = small(4);
  m.num_heads = 4;
  m.num_query_groups = 2;
  m.kv_channels = 2;
  m.moe_ffn_hidden = 2;  // ETP 4 does not divide it
  m.vocab_size = 128;
  RunSpec base;
  Hardware hw = hardware_preset("cpu");
  hw.gpus_per_node = 8;
  const SearchResult r = search_layouts(m, base, 4, hw);
  bool tp2_sp = false, tp2_nosp = false, etp2 = false;
  for (const Plan& p : r.fits) {
    tp2_sp |= p.degrees.tp == 2 && p.run.parallel.sequence_parallel;
    tp2_nosp |= p.degrees.tp == 2 && !p.run.parallel.sequence_parallel;
    etp2 |= p.degrees.etp == 2;
    EXPECT_FALSE(p.degrees.tp > 1 && p.degrees.ep > 1 && !p.run.parallel.sequence_parallel);
    EXPECT_LE(p.degrees.etp, 2);
    EXPECT_LE(p.degrees.tp, 2);  // 2 query groups
  }
  EXPECT_TRUE(tp2_sp);
  EXPECT_TRUE(tp2_nosp);
  EXPECT_TRUE(etp2);
  bool sp_missing = false, etp_width = false, groups = false;
  for (const auto& [run, why] : r.rejected) {
    sp_missing |= why.find("requires --sequence-parallel") != std::string::npos;
    etp_width |= run.parallel.etp == 4 && why.find("expert") != std::string::npos;
    groups |= run.parallel.tp == 4 && why.find("--num-query-groups") != std::string::npos;
  }
  EXPECT_TRUE(sp_missing);
  EXPECT_TRUE(etp_width);
  EXPECT_TRUE(groups);
}

// A vocabulary the TP ranks cannot split evenly is refused, naming the sizes and the fix.
TEST(PlanTpSearch, VocabularyNotDivisibleByTpIsRefused) {
  ModelSpec m = small(0);
  m.vocab_size = 17;
  try {
    validate_run(m, run_of(2, true), 2);
    ADD_FAILURE() << "a vocabulary of 17 on TP 2 was accepted";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("vocabulary 17"), std::string::npos) << w;
    EXPECT_NE(w.find("--make-vocab-size-divisible-by"), std::string::npos) << w;
  }
}

}  // namespace
}  // namespace moecore::plan
