// Parallel Folding: two rank generators over the same world, one group list per kind.
#include "parallel/process_groups.h"

#include <algorithm>

#include "core/check.h"

namespace moecore::parallel {

std::string_view group_name(GroupKind k) {
  switch (k) {
    case GroupKind::Tp: return "tp";
    case GroupKind::Cp: return "cp";
    case GroupKind::Dp: return "dp";
    case GroupKind::DpCp: return "dp_cp";
    case GroupKind::TpCp: return "tp_cp";
    case GroupKind::TpDpCp: return "tp_dp_cp";
    case GroupKind::Pp: return "pp";
    case GroupKind::Ep: return "ep";
    case GroupKind::ExptTp: return "expt_tp";
    case GroupKind::ExptDp: return "expt_dp";
    case GroupKind::TpEp: return "tp_ep";
    case GroupKind::TpEpPp: return "tp_ep_pp";
  }
  return "?";
}

std::string_view group_dims(GroupKind k) {
  switch (k) {
    case GroupKind::Tp: return "tp";
    case GroupKind::Cp: return "cp";
    case GroupKind::Dp: return "dp";
    case GroupKind::DpCp: return "dp-cp";
    case GroupKind::TpCp: return "tp-cp";
    case GroupKind::TpDpCp: return "tp-cp-dp";
    case GroupKind::Pp: return "pp";
    case GroupKind::Ep: return "ep";
    case GroupKind::ExptTp: return "tp";
    case GroupKind::ExptDp: return "dp";
    case GroupKind::TpEp: return "tp-ep";
    case GroupKind::TpEpPp: return "tp-ep-pp";
  }
  return "?";
}

bool is_expert_grid(GroupKind k) { return static_cast<int>(k) >= static_cast<int>(GroupKind::Ep); }

namespace {

std::string format_lists(const RankLists& lists, size_t max_groups = 4) {
  std::string s;
  for (size_t i = 0; i < lists.size() && i < max_groups; ++i) {
    s += i ? " [" : "[";
    for (size_t j = 0; j < lists[i].size(); ++j) {
      if (j) s += ',';
      s += std::to_string(lists[i][j]);
    }
    s += "]";
  }
  if (lists.size() > max_groups) s += " ...";
  return s;
}

}  // namespace

Layout make_layout(const ParallelConfig& cfg, int world_size) {
  Layout l;
  l.config = cfg;
  l.degrees = resolve_degrees(cfg, world_size);
  const Degrees& d = l.degrees;
  const RankGenerator attention(d.tp, d.cp, /*ep=*/1, d.dp, d.pp, cfg.order());
  const RankGenerator experts(d.etp, /*cp=*/1, d.ep, d.edp, d.pp, cfg.order());
  for (GroupKind k : kAllGroupKinds) {
    const RankGenerator& gen = is_expert_grid(k) ? experts : attention;
    l.groups[static_cast<int>(k)] = gen.ranks(group_dims(k));
  }
  // A stage must hold the attention and the experts of the same layers.
  const RankLists expert_pp = experts.ranks("pp");
  MOE_CHECK(expert_pp == l.of(GroupKind::Pp),
            "[parallel] the attention and expert grids disagree on the pipeline groups ({} vs "
            "{}) with order {}: make tp*cp = etp*ep or put pp last (drop "
            "--use-tp-pp-dp-mapping)",
            format_lists(l.of(GroupKind::Pp)), format_lists(expert_pp), cfg.order());
  return l;
}

int Layout::group_index(GroupKind k, int rank) const {
  const RankLists& lists = of(k);
  for (size_t g = 0; g < lists.size(); ++g) {
    if (std::find(lists[g].begin(), lists[g].end(), rank) != lists[g].end()) {
      return static_cast<int>(g);
    }
  }
  MOE_FAIL("[parallel] rank {} is in no '{}' group (world size {})", rank, group_name(k),
           degrees.world);
}

int Layout::position(GroupKind k, int rank) const {
  const std::vector<int>& g = of(k)[group_index(k, rank)];
  return static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
}

Communicator& ProcessGroup::communicator() const {
  MOE_CHECK(comm != nullptr,
            "[parallel] group '{}' has no communicator: call connect_communicators() first",
            name);
  return *comm;
}

Communicator& ProcessGroup::device_communicator() const {
  return device_comm != nullptr ? *device_comm : communicator();
}

ProcessGroups::ProcessGroups(Layout layout, int rank) : layout_(std::move(layout)), rank_(rank) {
  const int w = layout_.degrees.world;
  MOE_CHECK(rank >= 0 && rank < w, "[parallel] rank {} outside the world [0, {})", rank, w);
  world_.name = "world";
  world_.ranks.resize(w);
  for (int r = 0; r < w; ++r) world_.ranks[r] = r;
  world_.rank = rank;
  for (GroupKind k : kAllGroupKinds) {
    ProcessGroup& g = groups_[static_cast<int>(k)];
    g.name = std::string(group_name(k));
    g.ranks = layout_.of(k)[layout_.group_index(k, rank)];
    g.rank = static_cast<int>(std::find(g.ranks.begin(), g.ranks.end(), rank) - g.ranks.begin());
  }
}

ProcessGroups init_process_groups(const ParallelConfig& cfg, const Runtime& rt,
                                  const ModelDims& model) {
  validate_layout(cfg, rt.world_size, model);
  ProcessGroups groups(make_layout(cfg, rt.world_size), rt.rank);
  connect_communicators(groups);
  return groups;
}

}  // namespace moecore::parallel
