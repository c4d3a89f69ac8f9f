#include "plan/sizing_groups.h"

#include <optional>

#include "core/check.h"

namespace moecore::plan {
namespace {

class SizingCommunicator final : public parallel::Communicator {
 public:
  SizingCommunicator(std::string name, std::vector<int> ranks, int rank)
      : name_(std::move(name)), ranks_(std::move(ranks)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }

 protected:
  parallel::CommHandle refuse() const {
    MOE_FAIL("[plan] group '{}' is a sizing group: the planner sizes a rank, it never "
             "communicates",
             name_);
  }
  parallel::CommHandle start_all_reduce(void*, int64_t, DType, parallel::ReduceOp) override {
    return refuse();
  }
  parallel::CommHandle start_all_gather_v(const void*, void*, std::span<const int64_t>, bool,
                                          DType) override {
    return refuse();
  }
  parallel::CommHandle start_reduce_scatter_v(const void*, void*, std::span<const int64_t>, bool,
                                              DType, parallel::ReduceOp) override {
    return refuse();
  }
  parallel::CommHandle start_all_to_all_v(const void*, std::span<const int64_t>, void*,
                                          std::span<const int64_t>, DType) override {
    return refuse();
  }
  parallel::CommHandle start_broadcast(void*, int64_t, DType, int) override { return refuse(); }
  parallel::CommHandle start_send(const void*, int64_t, DType, int, int) override {
    return refuse();
  }
  parallel::CommHandle start_recv(void*, int64_t, DType, int, int) override { return refuse(); }
  parallel::CommHandle start_barrier() override { return refuse(); }

 private:
  std::string name_;
  std::vector<int> ranks_;
  int rank_;
};

}  // namespace

std::unique_ptr<parallel::ProcessGroups> sizing_groups(const parallel::Layout& layout, int rank) {
  auto groups = std::make_unique<parallel::ProcessGroups>(layout, rank);
  for (parallel::GroupKind k : parallel::kAllGroupKinds) {
    parallel::ProcessGroup& g = groups->group(k);
    g.comm = std::make_unique<SizingCommunicator>(g.name, g.ranks, g.rank);
  }
  parallel::ProcessGroup& w = groups->world();
  w.comm = std::make_unique<SizingCommunicator>(w.name, w.ranks, w.rank);
  return groups;
}

const parallel::Layout& planned_layout(const parallel::ParallelConfig& cfg, int world) {
  struct Cached {
    parallel::ParallelConfig cfg;
    int world = 0;
    parallel::Layout layout;
  };
  thread_local std::optional<Cached> last;
  // Every field that decides the rank lists (the timeout does not).
  const auto same = [&](const parallel::ParallelConfig& c) {
    return c.tp == cfg.tp && c.pp == cfg.pp && c.cp == cfg.cp && c.ep == cfg.ep &&
           c.expert_tp() == cfg.expert_tp() && c.sequence_parallel == cfg.sequence_parallel &&
           c.use_tp_pp_dp_mapping == cfg.use_tp_pp_dp_mapping &&
           c.first_stage_layers == cfg.first_stage_layers &&
           c.last_stage_layers == cfg.last_stage_layers;
  };
  if (!last || last->world != world || !same(last->cfg)) {
    last.reset();  // a failed make_layout leaves no stale entry
    last = Cached{cfg, world, parallel::make_layout(cfg, world)};
  }
  return last->layout;
}

}  // namespace moecore::plan
