// `moecore plan` against what `moecore train` measures, layout by layout: the predicted memory
// per rank (--hardware cpu: the trainer's planning pass, nothing reserved) against the process's
// peak resident set after a step, within 10%; the predicted all-to-all bytes per step against
// what the rank's EP all-to-alls sent (`alltoall_bytes`): equal for padded dispatch (static
// splits), within the routing's imbalance dropless. One rank and, under mpirun, DP 2, EP 2 and
// EP 2 x expert DP 2, with --bf16 and recomputation. The model is sized so the planned arena
// (weights, grads and Adam state of 50M parameters) is what the process holds, with tokens few
// enough that a step takes a fraction of a second. And EP 4 on 4 ranks, all-to-all bytes only,
// on a tiny model: at EP 2 the share of rows that leaves a rank, (ep-1)/ep, equals 1/ep, so only
// a wider EP tells the planner's factor from its mistakes; and EP 2 --bf16 (bf16 token and
// output-gradient rows), bytes only.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "common/command.h"
#include "common/paths.h"
#include "common/tolerances.h"
#include "documented_figure.h"

namespace moecore::plan {
namespace {

const std::string kModel =
    " --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 64"
    " --max-position-embeddings 64 --num-experts 32 --moe-ffn-hidden-size 1024"
    " --moe-router-topk 2 --vocab-size 1024 --swiglu --disable-bias-linear --normalization RMSNorm"
    " --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0"
    " --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2";
// For the all-to-all alone: a step in milliseconds, whose process the arena does not dominate.
const std::string kTinyModel =
    " --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    " --max-position-embeddings 32 --num-experts 8 --moe-ffn-hidden-size 64"
    " --moe-router-topk 2 --vocab-size 256 --swiglu --disable-bias-linear --normalization RMSNorm"
    " --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0"
    " --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2";

// A test's directory for its runs' files, unique to the process; its Open MPI session directory
// is the same path + ".ompi".
std::string run_dir(const std::string& what) {
  return ::testing::TempDir() + "moecore_plan_" + (what.empty() ? "" : what + "_") + "measured_" +
         std::to_string(::getpid());
}

struct Layout {
  const char* what;
  int ranks;
  std::string flags;  // layout, batch, precision, recomputation: given to plan and train alike
  bool a2a_exact;     // padded dispatch: the predicted bytes are exact
  std::string model = kModel;
  bool memory = true;  // false: a tiny model, whose process the arena does not dominate
  // The predicted bytes as docs/plan.md prints them, and the text that holds them there.
  const char* a2a_printed = nullptr;
  const char* a2a_line = nullptr;
};

std::string moecore() { return ::moecore::testing::moecore_binary(); }

// session: a directory of this test's own for Open MPI's session files, so that its mpiruns do
// not race other tests' on the shared top-level one (created and removed without locking).
std::string launcher(int ranks, const std::string& session) {
  if (ranks == 1) return "OMP_NUM_THREADS=1 ";
#ifdef MOECORE_HAVE_MPI
  const std::string env =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
      "OMP_NUM_THREADS=1 OMPI_MCA_orte_tmpdir_base=" +
      session + " ";
  return env + ::moecore::testing::mpiexec() + " --oversubscribe -np " + std::to_string(ranks) + " ";
#else
  (void)session;
  return "";
#endif
}

// One step of `moecore train ARGS` on `ranks` ranks, its metrics file's first line in *m (the
// file is removed). Fatal failures: the run's exit status, a missing line.
void one_step_metrics(int ranks, const std::string& session, const std::string& args,
                      const std::string& metrics, nlohmann::json* m) {
  const testing::CommandResult t = testing::run_command(
      launcher(ranks, session) + moecore() + " train" + args +
      " --train-iters 1 --lr 1e-4 --peak-tflops 0.1 --log-interval 1 --metrics-file " + metrics);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  std::ifstream in(metrics);
  std::string line;
  ASSERT_TRUE(std::getline(in, line)) << t.output;
  *m = nlohmann::json::parse(line);
  std::remove(metrics.c_str());
}

TEST(PlanVsMeasured, MemoryAndAllToAllBytesPerRank) {
  const std::vector<Layout> layouts = {
      {"1 rank, fp32", 1, " --micro-batch-size 2 --global-batch-size 2", false},
      {"1 rank, --bf16, selective layernorm + moe_act", 1,
       " --micro-batch-size 2 --global-batch-size 2 --bf16 --recompute-granularity selective"
       " --recompute-modules layernorm moe_act",
       false},
      {"DP 2", 2, " --micro-batch-size 2 --global-batch-size 4", false},
      {"EP 2, padded capacity 1, recompute moe", 2,
       " --micro-batch-size 2 --global-batch-size 4 --expert-model-parallel-size 2"
       " --moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"
       " --recompute-granularity selective --recompute-modules moe",
       true, kModel, true, "1,313,792",
       "measured ones exactly for padded dispatch (1,313,792 B with the `moe` module's rerun)"},
      {"EP 2 x expert DP 2, dropless, full recompute", 4,
       " --micro-batch-size 2 --global-batch-size 8 --expert-model-parallel-size 2"
       " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
       false},
      {"EP 4, padded capacity 1 (all-to-all only)", 4,
       " --micro-batch-size 2 --global-batch-size 8 --expert-model-parallel-size 4"
       " --moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity",
       true, kTinyModel, false, "198,144",
       "bytes only, padded): predicted and measured 198,144 B."},
      // --bf16: the tokens and the output gradient move as bf16 (MoELayer::set_bf16_dispatch),
      // the expert outputs and input gradients as f32.
      {"EP 2 --bf16, padded capacity 1 (all-to-all only)", 2,
       " --micro-batch-size 2 --global-batch-size 4 --expert-model-parallel-size 2 --bf16"
       " --moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity",
       true, kTinyModel, false},
  };
  const std::string dir = run_dir("");
  const std::string session = dir + ".ompi";
  ASSERT_EQ(::mkdir(session.c_str(), 0700), 0) << session;
  int n = 0;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.what);
    const testing::CommandResult p =
        testing::run_command(moecore() + " plan" + l.model + l.flags + " --hardware cpu --gpus " +
                             std::to_string(l.ranks) + " --json");
    ASSERT_EQ(p.exit_code, 0) << p.output;
    const auto plan = nlohmann::json::parse(p.output);
    ASSERT_EQ(plan["stages"][0]["source"], "arena");
    const double planned = plan["memory_per_rank_bytes"]["total"].get<double>();
    const double a2a_planned = plan["alltoall_bytes_per_step"].get<double>();
    if (l.a2a_printed != nullptr) {
      EXPECT_TRUE(documented(a2a_planned, l.a2a_printed, l.a2a_line));
    }
#ifndef MOECORE_HAVE_MPI
    if (l.ranks > 1) {
      std::printf("[ NOT RUN  ] %s: no mpirun in this build\n", l.what);
      continue;
    }
#endif

    nlohmann::json m;
    ASSERT_NO_FATAL_FAILURE(one_step_metrics(
        l.ranks, session, l.model + l.flags, dir + "." + std::to_string(n++) + ".jsonl", &m));
    const double rss = m["peak_mem_bytes"].get<double>();
    const double a2a = m["alltoall_bytes"].get<double>();
    std::printf(
        "[plan vs measured] %-48s memory %8.1f / %8.1f MiB (%.3f)  all-to-all %10.0f / "
        "%10.0f B (%.3f)\n",
        l.what, planned / (1 << 20), rss / (1 << 20), planned / rss, a2a_planned, a2a,
        a2a > 0 ? a2a_planned / a2a : 1.0);
    if (l.memory) {
      EXPECT_GT(planned, 350.0 * (1 << 20)) << "the arena must dominate the process";
      EXPECT_LE(std::abs(planned - rss), testing::kPlanMemoryRtol * rss)
          << planned << " planned, " << rss << " RSS";
    }
    if (l.flags.find("--expert-model-parallel-size") == std::string::npos) {
      EXPECT_EQ(a2a_planned, 0);
      EXPECT_EQ(a2a, 0);
    } else if (l.a2a_exact) {
      EXPECT_EQ(a2a_planned, a2a);
    } else {
      EXPECT_GT(a2a, 0);
      EXPECT_LE(std::abs(a2a_planned - a2a), testing::kPlanDroplessAlltoallRtol * a2a);
    }
  }
  testing::run_command("rm -rf " + session);
}

// The TP collectives' bytes per step of a rank, predicted (the plan's `tp_bytes_per_step`, by
// collective form) against what the rank's TP communicator counted (the metrics file's
// `tp_bytes`: Communicator::bytes_sent() of the tp group over the step), on TP 2 with and without
// SP (expert TP 1, so only the tp group's traffic; dropout off), with the QKV attention, a dense
// layer, a shared expert, multi-latent attention (with q LoRA; with linear_q_proj and
// mla_up_proj), two MTP depths (eh_proj's traffic, the regather of every head but the last
// depth's) and Megatron's biases, in f32 and --bf16 (with SP the inputs of the QKV projections,
// the dense MLPs, the shared expert, eh_proj and the head all-gathered as bf16: 2 bytes an
// element; without biases the output gradients' all-gathers of those regions too; the
// reductions f32). Every form is deterministic (no routing in it), so they must be equal, byte
// for byte.
TEST(PlanVsMeasured, TpBytesPerRankExactly) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "no mpirun in this build";
#else
  const std::string dir = run_dir("tp");
  const std::string session = dir + ".ompi";
  ASSERT_EQ(::mkdir(session.c_str(), 0700), 0) << session;
  // Multi-latent attention's region: its latents gathered instead of x (q LoRA, the norms), and
  // x for linear_q_proj with the raw rotary key gathered again by mla_up_proj.
  const std::string mla =
      " --multi-latent-attention --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4"
      " --v-head-dim 8 --qk-layernorm";
  // A dense layer first (--moe-layer-freq): the dense MLP's TP region. With Megatron's default
  // biases (the tiny model without --disable-bias-linear) the output gradients' all-gathers
  // stay f32 under --bf16: the biases' gradients sum their f32 values.
  const std::string biased = [&] {
    std::string b = kTinyModel;
    const std::string off = " --disable-bias-linear";
    b.erase(b.find(off), off.size());
    return b;
  }();
  const std::vector<std::pair<const char*, std::string>> models = {
      {"", ""},
      {" dense+moe", " --moe-layer-freq [0,1]"},
      {" shared", " --moe-shared-expert-intermediate-size 64"},
      {" mla", mla + " --q-lora-rank 24"},
      {" mla q proj", mla + " --recompute-granularity selective --recompute-modules mla_up_proj"},
      {" mtp", " --mtp-num-layers 2"},
      {" biases", " --moe-layer-freq [0,1] --moe-shared-expert-intermediate-size 64"}};
  int compared = 0;
  for (const char* precision : {"", " --bf16"})
  for (const auto& [name, extra] : models)
  for (const char* sp : {"", " --sequence-parallel"}) {
    const std::string& model = std::string(name) == " biases" ? biased : kTinyModel;
    SCOPED_TRACE(std::string(name) + sp + precision);
    const std::string flags = std::string(" --micro-batch-size 2 --global-batch-size 2") +
                              " --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1" +
                              sp + extra + precision;
    const testing::CommandResult p = testing::run_command(
        moecore() + " plan" + model + flags + " --hardware cpu --gpus 2 --json");
    ASSERT_EQ(p.exit_code, 0) << p.output;
    const auto plan = nlohmann::json::parse(p.output);
    nlohmann::json m;
    ASSERT_NO_FATAL_FAILURE(one_step_metrics(
        2, session, model + flags,
        dir + (*sp ? ".sp" : ".nosp") + std::to_string(compared) + ".jsonl", &m));
    ASSERT_TRUE(m.contains("tp_bytes")) << "the metrics file has no tp_bytes: " << m.dump();
    for (const char* form : {"all_gather", "reduce_scatter", "all_reduce"}) {
      const double want = plan["tp_bytes_per_step"][form].get<double>();
      const double got = m["tp_bytes"][form].get<double>();
      std::printf("[plan vs measured] TP 2%-11s%-20s%-7s %-15s %10.0f / %10.0f B\n", name, sp,
                  precision, form, want, got);
      EXPECT_EQ(want, got) << form;
    }
    ++compared;
  }
  testing::run_command("rm -rf " + session);
  EXPECT_EQ(compared, 28);
#endif
}

// The pipeline's point-to-point bytes per step of pp rank 0, predicted (the plan's
// `pp_first_stage_bytes_per_step`) against what its pipeline communicator sent (the metrics
// file's `pp_bytes`, which rank 0 writes): the activations forward, the gradients of its later
// chunks back, the tied table's gradient. Under --bf16 the activations (the residual stream's
// bf16 values) move as bf16, 2 bytes an element; with --fp32-residual-connection, and every
// gradient, in f32. PP 2 with one and two virtual stages per rank, tied and untied, and
// PP 2 x TP 2 + SP (the boundary is the rank's sequence slice). Deterministic: equal, byte for
// byte.
TEST(PlanVsMeasured, PpBytesOfTheFirstStageExactly) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "no mpirun in this build";
#else
  const std::string model =
      " --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
      " --max-position-embeddings 32 --num-experts 8 --moe-ffn-hidden-size 64"
      " --moe-router-topk 2 --vocab-size 256 --swiglu --disable-bias-linear"
      " --normalization RMSNorm --position-embedding-type rope --attention-dropout 0"
      " --hidden-dropout 0 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2"
      " --micro-batch-size 2 --global-batch-size 4";
  const std::string dir = run_dir("pp");
  const std::string session = dir + ".ompi";
  ASSERT_EQ(::mkdir(session.c_str(), 0700), 0) << session;
  struct Row {
    const char* what;
    int ranks;
    std::string flags;
  };
  const std::string pp2 = " --pipeline-model-parallel-size 2";
  const std::vector<Row> rows = {
      {"PP 2, f32", 2, pp2},
      {"PP 2, --bf16", 2, pp2 + " --bf16"},
      {"PP 2, --bf16, untied", 2, pp2 + " --bf16 --untie-embeddings-and-output-weights"},
      {"PP 2, --bf16 --fp32-residual-connection", 2, pp2 + " --bf16 --fp32-residual-connection"},
      {"PP 2 x vp 2, --bf16", 2, pp2 + " --num-layers-per-virtual-pipeline-stage 1 --bf16"},
      {"PP 2 x TP 2 + SP, --bf16", 4,
       pp2 + " --tensor-model-parallel-size 2 --sequence-parallel --bf16"},
  };
  int compared = 0;
  for (const Row& r : rows) {
    SCOPED_TRACE(r.what);
    const testing::CommandResult p =
        testing::run_command(moecore() + " plan" + model + r.flags + " --hardware cpu --gpus " +
                             std::to_string(r.ranks) + " --json");
    ASSERT_EQ(p.exit_code, 0) << p.output;
    const double want =
        nlohmann::json::parse(p.output)["pp_first_stage_bytes_per_step"].get<double>();
    nlohmann::json m;
    ASSERT_NO_FATAL_FAILURE(one_step_metrics(
        r.ranks, session, model + r.flags, dir + "." + std::to_string(compared) + ".jsonl", &m));
    ASSERT_TRUE(m.contains("pp_bytes")) << "the metrics file has no pp_bytes: " << m.dump();
    const double got = m["pp_bytes"].get<double>();
    std::printf("[plan vs measured] %-42s pp rank 0 sent %10.0f / %10.0f B\n", r.what, want,
                got);
    EXPECT_GT(got, 0);
    EXPECT_EQ(want, got);
    ++compared;
  }
  testing::run_command("rm -rf " + session);
  EXPECT_EQ(compared, static_cast<int>(rows.size()));
#endif
}

}  // namespace
}  // namespace moecore::plan

namespace moecore::plan {
namespace {

// The first error line of a command's output, without the rank prefix mpirun's ranks print and
// the check's source location (which differs by design: the same message from the same check).
std::string error_message(const std::string& output) {
  const size_t at = output.find("error: ");
  if (at == std::string::npos) return "";
  std::string m = output.substr(at, output.find('\n', at) - at);
  // Another rank's line may follow on the same line of the launcher's output.
  const size_t other = m.find("[rank ", 1);
  return other == std::string::npos ? m : m.substr(0, other);
}

// A layout that cannot work stops `moecore plan` with the message `moecore train` gives under
// mpirun for the same flags (EP that leaves no whole expert-data-parallel size, experts not
// divisible by EP, a global batch that does not split over DP).
TEST(PlanValidation, SameMessagesAsTrain) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "no mpirun in this build";
#else
  const std::string tiny = ::moecore::testing::source_dir() + "/configs/tiny.toml";
  const std::string session =
      ::testing::TempDir() + "moecore_plan_validation_" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(session.c_str(), 0700), 0) << session;
  for (const char* bad :
       {" --expert-model-parallel-size 3", " --expert-model-parallel-size 4 --num-experts 6",
        " --micro-batch-size 2 --global-batch-size 6"}) {
    SCOPED_TRACE(bad);
    const testing::CommandResult p =
        testing::run_command(moecore() + " plan --config " + tiny + " --gpus 4" + bad);
    const testing::CommandResult t =
        testing::run_command(launcher(4, session) + moecore() + " train --config " + tiny +
                             " --train-iters 1 --lr-warmup-iters 0" + bad);
    EXPECT_NE(p.exit_code, 0) << p.output;
    EXPECT_NE(t.exit_code, 0) << t.output;
    EXPECT_NE(error_message(p.output), "") << p.output;
    EXPECT_EQ(error_message(p.output), error_message(t.output)) << t.output;
  }
  testing::run_command("rm -rf " + session);
#endif
}

}  // namespace
}  // namespace moecore::plan
