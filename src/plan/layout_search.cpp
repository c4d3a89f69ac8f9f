#include "plan/layout_search.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/check.h"

namespace moecore::plan {
namespace {

std::vector<int> divisors_up_to(int64_t n, int64_t cap) {
  std::vector<int> out;
  for (int64_t k = 1; k <= std::min(n, cap); ++k) {
    if (n % k == 0) out.push_back(static_cast<int>(k));
  }
  return out;
}

std::string recompute_name(const RunSpec& r) {
  if (r.recompute.full()) return fmt::format("full uniform {}", r.recompute.num_layers);
  if (r.recompute.selective()) {
    std::string s = "selective";
    for (const auto& m : r.recompute_modules) s += " " + m;
    return s;
  }
  return "none";
}

}  // namespace

std::string groups_flags(const RunSpec& r) {
  std::string s = fmt::format(
      "--tensor-model-parallel-size {} --context-parallel-size {} "
      "--pipeline-model-parallel-size {} --expert-model-parallel-size {} "
      "--expert-tensor-parallel-size {}",
      r.parallel.tp, r.parallel.cp, r.parallel.pp, r.parallel.ep, r.parallel.expert_tp());
  if (r.parallel.sequence_parallel) s += " --sequence-parallel";
  return s;
}

std::string layout_flags(const RunSpec& r) {
  std::string s = groups_flags(r);
  const parallel::ParallelConfig& pc = r.parallel;
  if (pc.vp_stages > 1) s += fmt::format(" --num-virtual-stages-per-pipeline-rank {}", pc.vp_stages);
  if (pc.layers_per_vp_stage > 0) {
    s += fmt::format(" --num-layers-per-virtual-pipeline-stage {}", pc.layers_per_vp_stage);
  }
  if (pc.first_stage_layers > 0) {
    s += fmt::format(" --decoder-first-pipeline-num-layers {}", pc.first_stage_layers);
  }
  if (pc.last_stage_layers > 0) {
    s += fmt::format(" --decoder-last-pipeline-num-layers {}", pc.last_stage_layers);
  }
  if (pc.account_for_embedding) s += " --account-for-embedding-in-pipeline-split";
  if (pc.account_for_loss) s += " --account-for-loss-in-pipeline-split";
  if (!pc.layout.empty()) s += fmt::format(" --pipeline-model-parallel-layout \"{}\"", pc.layout);
  if (r.distributed_optimizer) s += " --use-distributed-optimizer";
  return s;
}

SearchResult search_layouts(const ModelSpec& m, const RunSpec& base, int world,
                            const Hardware& hw, const ModelConfig* trainer_cfg) {
  SearchResult out;
  const int64_t E = std::max<int64_t>(m.num_experts, 1);
  std::vector<RecomputeConfig> recomputes;
  std::vector<std::vector<std::string>> recompute_mods;
  {
    RecomputeConfig none;
    recomputes.push_back(none);
    recompute_mods.push_back({});
    RecomputeConfig sel;
    sel.granularity = RecomputeGranularity::Selective;
    std::vector<std::string> mods = base.recompute.selective() ? base.recompute_modules
                                                               : std::vector<std::string>{"core_attn"};
    sel.module_names.clear();
    for (const auto& s : mods) {
      if (s != "mla_up_proj") sel.module_names.push_back(s);
    }
    if (sel.module_names.empty()) sel.module_names = {"core_attn"};
    recomputes.push_back(sel);
    recompute_mods.push_back(mods);
    RecomputeConfig full;
    full.granularity = RecomputeGranularity::Full;
    full.method = RecomputeMethod::Uniform;
    full.num_layers = 1;
    recomputes.push_back(full);
    recompute_mods.push_back({});
  }
  const std::vector<int> cps = m.seq_length >= 16384 ? std::vector<int>{1, 2, 4, 8}
                                                     : std::vector<int>{1};
  for (int tp : divisors_up_to(m.num_heads, std::min(8, hw.gpus_per_node))) {
    if ((tp & (tp - 1)) != 0) continue;
    for (int cp : cps) {
      for (int pp : divisors_up_to(m.num_layers, 16)) {
        if (world % (tp * cp * pp) != 0) continue;
        // The given placement flags hold at the given pipeline size; another size gets an even
        // split. A layout string or --num-layers-per-virtual-pipeline-stage fixes the virtual
        // stages; otherwise 1, 2 and 4 per rank are tried. pipeline_layout and the schedule's
        // checks (validate_run) refuse what the trainer would refuse.
        const bool given = pp == base.parallel.pp;
        const bool fixed_vp = given && (!base.parallel.layout.empty() ||
                                        base.parallel.layers_per_vp_stage > 0);
        for (int vpp : fixed_vp ? std::vector<int>{0} : std::vector<int>{1, 2, 4}) {
          if (vpp > 1 && pp == 1) continue;
          for (int ep : divisors_up_to(E, world / pp)) {
            if ((ep & (ep - 1)) != 0 || (m.num_experts == 0 && ep > 1)) continue;
            // Expert TP: every power of two within a node (validate_run refuses one that does
            // not divide the expert width or the world); sequence parallelism on and off (off is
            // refused with EP and TP together, as Megatron).
            std::vector<int> etps = {1};
            for (int e = 2; m.num_experts > 0 && e <= hw.gpus_per_node && e * ep <= world / pp;
                 e *= 2) {
              etps.push_back(e);
            }
            std::vector<std::pair<int, bool>> expert_sp;
            for (int etp : etps) {
              expert_sp.push_back({etp, tp > 1});
              if (tp > 1) expert_sp.push_back({etp, false});
            }
            for (const auto& [etp, sp] : expert_sp) {
              for (bool dist : {false, true}) {
                for (size_t rc = 0; rc < recomputes.size(); ++rc) {
                  RunSpec r = base;
                  r.parallel.tp = tp;
                  r.parallel.cp = cp;
                  r.parallel.pp = pp;
                  r.parallel.ep = ep;
                  r.parallel.etp = etp;
                  r.parallel.sequence_parallel = sp;
                  if (!given) {
                    r.parallel.first_stage_layers = r.parallel.last_stage_layers = 0;
                    r.parallel.account_for_embedding = r.parallel.account_for_loss = false;
                    r.parallel.layout.clear();
                    r.parallel.layers_per_vp_stage = 0;
                    r.parallel.microbatch_group_size = 0;
                  }
                  if (!fixed_vp) r.parallel.vp_stages = vpp > 1 ? vpp : 0;
                  r.distributed_optimizer = dist;
                  r.recompute = recomputes[rc];
                  r.recompute_modules = recompute_mods[rc];
                  ++out.tried;
                  try {
                    validate_run(m, r, world);
                    std::optional<ModelConfig> tc;
                    if (trainer_cfg) {  // this candidate's recomputation
                      tc = *trainer_cfg;
                      tc->recompute = trainer_recompute(r, tc->multi_latent_attention);
                    }
                    Plan p = make_plan(m, r, world, hw, tc ? &*tc : nullptr);
                    if (!p.fits) {
                      out.rejected.push_back(
                          {r, fmt::format("needs {:.1f} GiB on stage {} > {:.0f} GiB",
                                          p.memory.max_total / (1024.0 * 1024 * 1024),
                                          p.memory.worst_stage, hw.memory_gib)});
                      continue;
                    }
                    out.fits.push_back(std::move(p));
                  } catch (const Error& e) {
                    // The message without the failed check's location.
                    const std::string what = e.what();
                    out.rejected.push_back({r, what.substr(0, what.find(" (check `"))});
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.fits.begin(), out.fits.end(), [](const Plan& a, const Plan& b) {
    return a.roof.tokens_per_second > b.roof.tokens_per_second;
  });
  return out;
}

std::string search_text(const SearchResult& r, int top) {
  std::string o = fmt::format("[plan] search: {} layouts tried, {} fit, {} rejected\n", r.tried,
                              r.fits.size(), r.rejected.size());
  o += fmt::format("  {:>3} {:>3} {:>3} {:>3} {:>3} {:>3} {:>3} {:>4} {:<4} {:<22} {:>10} "
                   "{:>10} {:>8}\n",
                   "tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "dopt", "recompute",
                   "mem GiB", "tokens/s", "TFLOP/s");
  for (int i = 0; i < std::min<int>(top, static_cast<int>(r.fits.size())); ++i) {
    const Plan& p = r.fits[i];
    const parallel::Degrees& d = p.degrees;
    o += fmt::format("  {:>3} {:>3} {:>3} {:>3} {:>3} {:>3} {:>3} {:>4} {:<4} {:<22} {:>10.1f} "
                     "{:>10.0f} {:>8.0f}\n",
                     d.tp, d.cp, d.pp, virtual_stages(p.model, p.run), d.ep, d.etp, d.dp, d.edp,
                     p.run.distributed_optimizer ? "yes" : "no", recompute_name(p.run),
                     p.memory.max_total / (1024.0 * 1024 * 1024), p.roof.tokens_per_second,
                     p.roof.tflops_per_gpu);
  }
  // The reasons, most frequent first, each with one example layout.
  std::map<std::string, std::pair<int, std::string>> reasons;
  for (const auto& [run, why] : r.rejected) {
    // The reason with its numbers left out, so that one rule is one line.
    std::string key;
    for (char ch : why) {
      const bool digit = ch >= '0' && ch <= '9';
      if (!digit) key += ch;
      else if (key.empty() || key.back() != 'N') key += 'N';
    }
    if (key.rfind("needs", 0) == 0) key = "does not fit in device memory";
    auto& e = reasons[key];
    if (e.first++ == 0) e.second = layout_flags(run) + ": " + why;
  }
  std::vector<std::pair<std::string, std::pair<int, std::string>>> sorted(reasons.begin(),
                                                                           reasons.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  o += "[plan] rejected (reason, count, an example):\n";
  for (size_t i = 0; i < std::min<size_t>(10, sorted.size()); ++i) {
    o += fmt::format("  {:>6} x {}\n         e.g. {}\n", sorted[i].second.first, sorted[i].first,
                     sorted[i].second.second);
  }
  return o;
}

std::string search_json(const SearchResult& r, int top) {
  using J = nlohmann::ordered_json;
  J j;
  j["tried"] = r.tried;
  j["fit"] = r.fits.size();
  J fits = J::array();
  for (int i = 0; i < std::min<int>(top, static_cast<int>(r.fits.size())); ++i) {
    const Plan& p = r.fits[i];
    const parallel::Degrees& d = p.degrees;
    fits.push_back({{"tp", d.tp}, {"cp", d.cp}, {"pp", d.pp}, {"vpp", virtual_stages(p.model, p.run)}, {"ep", d.ep},
                    {"etp", d.etp}, {"dp", d.dp}, {"edp", d.edp},
                    {"sequence_parallel", p.run.parallel.sequence_parallel},
                    {"distributed_optimizer", p.run.distributed_optimizer},
                    {"recompute", recompute_name(p.run)},
                    {"flags", layout_flags(p.run)},
                    {"groups_flags", groups_flags(p.run)},
                    {"memory_bytes", p.memory.max_total},
                    {"tokens_per_second", p.roof.tokens_per_second},
                    {"tflops_per_gpu", p.roof.tflops_per_gpu}});
  }
  j["layouts"] = fits;
  J rej = J::array();
  for (size_t i = 0; i < std::min<size_t>(10, r.rejected.size()); ++i) {
    rej.push_back({{"flags", layout_flags(r.rejected[i].first)}, {"reason", r.rejected[i].second}});
  }
  j["rejected_examples"] = rej;
  j["rejected"] = r.rejected.size();
  return j.dump();
}

}  // namespace moecore::plan
