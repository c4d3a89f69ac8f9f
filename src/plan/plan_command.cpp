#include "plan/plan_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <numeric>

#include "core/check.h"
#include "plan/layout_search.h"
#include "plan/plan.h"
#include "pipeline/schedule.h"
#include "cli/flag_ranges.h"
#include "cli/megatron_compat.h"
#include "cli/train_flags.h"

namespace moecore::plan {
namespace {

// The planner's own flags (beyond Megatron's table), with their arity.
const std::vector<cli::OwnFlag>& own_flags() {
  static const std::vector<cli::OwnFlag> f = {
      {"--hf-config", 1, 1},      {"--hardware", 1, 1},     {"--gpus", 1, 1},
      {"--world-size", 1, 1},     {"--gpus-per-node", 1, 1}, {"--peak-tflops", 1, 1},
      {"--device-memory-gib", 1, 1}, {"--hbm-tbps", 1, 1},  {"--nvlink-gbps", 1, 1},
      {"--internode-gbps", 1, 1}, {"--reserved-gib", 1, 1}, {"--search", 0, 0},      {"--print-schedule", 0, 0},
      {"--json", 0, 0},           {"--top", 1, 1},          {"--help", 0, 0}};
  return f;
}

const cli::GivenFlag* own(const cli::ParsedArgs& a, const std::string& name) {
  for (const cli::GivenFlag& g : a.flags) {
    if (g.megatron == nullptr && g.name == name) return &g;
  }
  return nullptr;
}

// A finite number (NaN and infinities are no hardware figure).
double own_num(const cli::ParsedArgs& a, const std::string& name, double dflt) {
  const cli::GivenFlag* g = own(a, name);
  if (g == nullptr) return dflt;
  double v = 0;
  size_t end = 0;
  try {
    v = std::stod(g->values.at(0), &end);
  } catch (const std::exception&) {
    end = 0;
  }
  MOE_CHECK(end > 0 && end == g->values.at(0).size() && std::isfinite(v),
            "[plan] {} takes a finite number, got '{}'", name, g->value_text());
  return v;
}

// A whole number in [lo, hi].
int64_t own_int(const cli::ParsedArgs& a, const std::string& name, int64_t dflt, int64_t lo,
                int64_t hi, const char* why = "") {
  const cli::GivenFlag* g = own(a, name);
  if (g == nullptr) return dflt;
  const std::string& t = g->values.at(0);
  int64_t v = 0;
  size_t end = 0;
  try {
    v = std::stoll(t, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  MOE_CHECK(end > 0 && end == t.size(), "[plan] {} takes a whole number, got '{}'", name, t);
  MOE_CHECK(v >= lo && v <= hi, "[plan] {}={} must be >= {} and <= {}{}", name, v, lo, hi, why);
  return v;
}

// Flags that describe the layout or the planner, not the model: what `moecore train` parses
// without them gives the trainer's ModelConfig for the same model.
bool layout_flag(const cli::GivenFlag& g) {
  if (g.megatron == nullptr) return true;
  static const char* names[] = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                "--context-parallel-size", "--cp-comm-type",
                                "--expert-model-parallel-size",
                                "--expert-tensor-parallel-size", "--sequence-parallel",
                                "--num-virtual-stages-per-pipeline-rank",
                                "--num-layers-per-virtual-pipeline-stage",
                                "--microbatch-group-size-per-virtual-pipeline-stage",
                                "--account-for-embedding-in-pipeline-split",
                                "--account-for-loss-in-pipeline-split",
                                "--pipeline-model-parallel-layout",
                                "--use-distributed-optimizer", "--decoder-first-pipeline-num-layers",
                                "--decoder-last-pipeline-num-layers", "--global-batch-size"};
  for (const char* n : names) {
    if (g.megatron->name() == n) return true;
  }
  return false;
}

const char* kHelp =
    "moecore plan: memory, communication and throughput of a layout (docs/plan.md)\n"
    "  model:    Megatron flags (--num-layers ...), --config FILE (configs/*.toml) or\n"
    "            --hf-config config.json; MLA (--multi-latent-attention, --q-lora-rank, ...)\n"
    "            and --mtp-num-layers are accepted\n"
    "  layout:   --tensor-model-parallel-size, --pipeline-model-parallel-size,\n"
    "            --num-virtual-stages-per-pipeline-rank, --expert-model-parallel-size,\n"
    "            --expert-tensor-parallel-size, --context-parallel-size, --cp-comm-type,\n"
    "            --sequence-parallel, --use-distributed-optimizer,\n"
    "            --gpus N (default: the smallest world)\n"
    "  run:      --micro-batch-size, --global-batch-size, --seq-length, --bf16, --recompute-*\n"
    "  hardware: --hardware h100|h200|b200|gb200|gb300|cpu (default h100), --gpus-per-node,\n"
    "            --peak-tflops, --device-memory-gib, --hbm-tbps, --nvlink-gbps,\n"
    "            --internode-gbps, --reserved-gib\n"
    "  output:   --json; --search (every layout of --gpus N that fits, best first; --top K);\n"
    "            --print-schedule (each pipeline rank's forwards and backwards, in order)\n";

}  // namespace

int run_plan(const std::vector<std::string>& args, std::string& out) {
  const cli::ParsedArgs a =
      cli::parse_megatron_argv(args, own_flags(), cli::moecore_extra_choices());
  if (a.help || own(a, "--help")) {
    out = kHelp;
    return 0;
  }
  cli::check_flag_ranges(a);  // the trainer's ranges: the same message for the same value
  ModelSpec m;
  if (const cli::GivenFlag* hf = own(a, "--hf-config")) {
    m = spec_from_hf_config(hf->values.at(0));
  } else {
    m = model_from_args(a);
  }
  RunSpec run = run_from_args(a);
  if (own(a, "--hf-config") == nullptr) pad_vocab(m, a, run.parallel.tp);
  if (const cli::GivenFlag* g = a.find_dest("seq_length")) m.seq_length = std::stoll(g->values.at(0));
  check_model_spec(m, run, own(a, "--hf-config") != nullptr);

  Hardware hw = hardware_preset(own(a, "--hardware") ? own(a, "--hardware")->values.at(0) : "h100");
  hw.gpus_per_node =
      static_cast<int>(own_int(a, "--gpus-per-node", hw.gpus_per_node, 1, kMaxPlanGpus));
  // Each figure must be positive (the reserved memory may be 0).
  auto positive = [&](const char* name, double dflt, bool zero_ok = false) {
    const double v = own_num(a, name, dflt);
    MOE_CHECK(zero_ok ? v >= 0 : v > 0, "[plan] {}={} must be {} 0", name, v,
              zero_ok ? ">=" : ">");
    return v;
  };
  if (own(a, "--peak-tflops") != nullptr) {
    hw.peak_tflops_bf16 = hw.peak_tflops_fp32 = positive("--peak-tflops", 0);
  }
  hw.memory_gib = positive("--device-memory-gib", hw.memory_gib);
  hw.hbm_tbps = positive("--hbm-tbps", hw.hbm_tbps);
  hw.nvlink_gbps = positive("--nvlink-gbps", hw.nvlink_gbps);
  hw.internode_gbps = positive("--internode-gbps", hw.internode_gbps);
  hw.reserved_gib = positive("--reserved-gib", hw.reserved_gib, true);

  const parallel::ParallelConfig& pc = run.parallel;
  // A search's time grows with the world (each layout's process groups): kMaxPlanGpus bounds it.
  const char* why = " (leave it out for the smallest world the layout needs)";
  const int64_t world_size = own_int(a, "--world-size", 0, 1, kMaxPlanGpus, why);
  int world = static_cast<int>(own_int(a, "--gpus", world_size, 1, kMaxPlanGpus, why));
  if (world <= 0) {
    world = std::lcm(pc.tp * pc.cp, pc.ep * pc.expert_tp()) * pc.pp;
  }
  const bool json = own(a, "--json") != nullptr;
  // The trainer's own ModelConfig when `moecore train` accepts the model flags.
  std::optional<ModelConfig> trainer_cfg;
  std::string trainer_note;
  if (own(a, "--hf-config") == nullptr) {
    try {
      // --train-iters and --lr do not change the model; the trainer requires them.
      std::vector<std::string> targs;
      if (a.find_dest("train_iters") == nullptr) targs = {"--train-iters=1", "--lr-warmup-iters=0"};
      if (a.find_dest("lr") == nullptr) targs.push_back("--lr=1e-4");
      const auto model_args = a.args_for([](const cli::GivenFlag& g) { return !layout_flag(g); });
      targs.insert(targs.end(), model_args.begin(), model_args.end());
      trainer_cfg = cli::parse_train_args(targs).model;
    } catch (const Error& e) {
      trainer_note = fmt::format("[plan] note: moecore train refuses these flags ({}); the "
                                 "planning pass runs on the model derived from them\n",
                                 e.what());
    } catch (const std::exception& e) {
      trainer_note = fmt::format("[plan] note: moecore train refuses these flags ({})\n",
                                 e.what());
    }
  }
  if (own(a, "--search")) {
    MOE_CHECK(own(a, "--gpus") || own(a, "--world-size"), "[plan] --search needs --gpus N");
    const SearchResult r = search_layouts(m, run, world, hw, trainer_cfg ? &*trainer_cfg : nullptr);
    const int top = static_cast<int>(own_int(a, "--top", 10, 1, 1 << 20));
    out = json ? search_json(r, top) + "\n" : search_text(r, top);
    return 0;
  }
  validate_run(m, run, world);
  const Plan p = make_plan(m, run, world, hw, trainer_cfg ? &*trainer_cfg : nullptr);
  out = json ? plan_json(p) + "\n" : trainer_note + plan_text(p);
  if (own(a, "--print-schedule") != nullptr && !json) {
    // F<micro-batch>.<chunk> / B<micro-batch>.<chunk>: the order the pipeline runner follows.
    for (const StageMemory& s : p.memory.stages) {
      pipeline::ScheduleConfig c;
      c.pp = p.degrees.pp;
      c.rank = s.stage;
      c.vp = static_cast<int>(s.chunks.size());
      c.num_microbatches = s.num_microbatches;
      c.group_size = run.parallel.microbatch_group_size;
      out += fmt::format("[plan] schedule of pp rank {} ({} warm-up forwards, {} recomputed): {}\n",
                         s.stage, pipeline::warmup_forwards(c), pipeline::recomputed_forwards(c),
                         pipeline::format_schedule(c));
    }
  }
  return 0;
}

Subcommand add_plan_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "plan", "Memory, communication and throughput of a model and layout (no GPUs needed)");
  cli->prefix_command();
  cli->set_help_flag();
  cli->allow_extras();
  return Subcommand{cli, [cli]() {
                      std::string out;
                      int rc = 0;
                      try {
                        rc = run_plan(cli->remaining(), out);
                      } catch (const CLI::ParseError& e) {
                        std::cerr << "error: [flags] " << e.what() << "\n";
                        return 2;
                      }
                      std::cout << out;
                      return rc;
                    }};
}

}  // namespace moecore::plan
