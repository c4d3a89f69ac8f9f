#include "parallel/groups_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/check.h"
#include "parallel/pipeline_layout.h"

namespace moecore::parallel {
namespace {

std::string list_str(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

struct GroupsFlags {
  int world_size = 0;
  ParallelConfig parallel;
  std::optional<int64_t> num_layers, num_experts, num_heads, num_query_groups, ffn_hidden,
      moe_ffn_hidden, seq_length, shared_ffn_hidden;
  bool json = false;
  int rank = -1;
};

}  // namespace

std::string layout_json(const Layout& layout) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (GroupKind k : kAllGroupKinds) j[std::string(group_name(k))] = layout.of(k);
  return j.dump();
}

void print_layout(std::ostream& os, const Layout& layout, int rank) {
  const Degrees& d = layout.degrees;
  os << fmt::format("world {} ranks, order {} (fastest-varying first)\n", d.world,
                    layout.config.order());
  os << fmt::format("  attention grid: tp {} x cp {} x dp {} x pp {}\n", d.tp, d.cp, d.dp, d.pp);
  os << fmt::format("  expert grid:    etp {} x ep {} x edp {} x pp {}\n", d.etp, d.ep, d.edp,
                    d.pp);
  for (GroupKind k : kAllGroupKinds) {
    const RankLists& lists = layout.of(k);
    std::string line = fmt::format("{:<9} {:>3} x {:<3}", group_name(k), lists.size(),
                                   lists.empty() ? 0 : lists[0].size());
    for (const auto& g : lists) {
      line += ' ';
      line += list_str(g);
    }
    os << line << "\n";
  }
  if (rank >= 0) {
    os << fmt::format("rank {}:\n", rank);
    for (GroupKind k : kAllGroupKinds) {
      const auto& g = layout.of(k)[layout.group_index(k, rank)];
      os << fmt::format("  {:<9} {} (position {})\n", group_name(k), list_str(g),
                        layout.position(k, rank));
    }
  }
}

Subcommand add_groups_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "groups", "Print the process groups of a parallel layout (no processes are launched)");
  auto f = std::make_shared<GroupsFlags>();
  cli->add_option("--world-size", f->world_size, "Number of ranks the job would run on")
      ->required();
  add_parallel_flags(*cli, f->parallel);
  const char* m = "Model (optional: checked against the layout when given)";
  cli->add_option("--num-layers", f->num_layers, "Transformer layers")->group(m);
  cli->add_option("--num-experts", f->num_experts, "Routed experts (0: dense)")->group(m);
  cli->add_option("--num-attention-heads", f->num_heads, "Query heads")->group(m);
  cli->add_option("--num-query-groups", f->num_query_groups, "KV heads")->group(m);
  cli->add_option("--ffn-hidden-size", f->ffn_hidden, "Dense MLP width")->group(m);
  cli->add_option("--moe-ffn-hidden-size", f->moe_ffn_hidden, "Expert width")->group(m);
  cli->add_option("--seq-length", f->seq_length, "Sequence length")->group(m);
  cli->add_option("--moe-shared-expert-intermediate-size", f->shared_ffn_hidden,
                  "Shared expert width")
      ->group(m);
  auto* json = cli->add_flag("--json", f->json,
                             "One JSON object: group name -> list of rank lists");
  cli->add_option("--rank", f->rank, "Also show the groups of this rank")->excludes(json);
  return Subcommand{cli, [f]() {
                      // The padded vocabulary is a multiple of TP by construction (the
                      // padding is --make-vocab-size-divisible-by x TP): not asked for.
                      const ModelDims dims{.num_layers = f->num_layers,
                                           .num_experts = f->num_experts,
                                           .num_attention_heads = f->num_heads,
                                           .num_query_groups = f->num_query_groups,
                                           .ffn_hidden = f->ffn_hidden,
                                           .moe_ffn_hidden = f->moe_ffn_hidden,
                                           .seq_length = f->seq_length,
                                           .shared_ffn_hidden = f->shared_ffn_hidden,
                                           .vocab_size = std::nullopt,
                                           .mtp_num_layers = std::nullopt};
                      validate_layout(f->parallel, f->world_size, dims);
                      const Layout layout = make_layout(f->parallel, f->world_size);
                      if (f->json) {
                        std::cout << layout_json(layout) << "\n";
                        return 0;
                      }
                      MOE_CHECK(f->rank >= -1 && f->rank < f->world_size,
                                "[groups] --rank {} outside the world of {} ranks", f->rank,
                                f->world_size);
                      print_layout(std::cout, layout, f->rank);
                      if (f->num_layers) {
                        std::cout << "pipeline stages:\n"
                                  << pipeline_layout(f->parallel, *f->num_layers).describe();
                      }
                      return 0;
                    }};
}

}  // namespace moecore::parallel
