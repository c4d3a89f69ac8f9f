// Process groups of Parallel Folding, built from the degrees as Megatron-Core builds them: an
// attention grid (tp x cp x dp x pp) and an expert grid (etp x ep x edp x pp) over the same
// ranks, each from a RankGenerator with the same order string. Built once, validated, and
// passed by reference: no global state. The rank lists are pure arithmetic (testable and
// printable without launching anything); connect_communicators() adds one communicator per
// group when the processes are actually running.
// Each group has two communicators: the host's (MPI; the local one for one process), which
// moves host memory (agreements, the step report's values, the checkpoint protocol, the counts
// the host sizes a collective from), and the device's, which moves the execution context's
// memory (activations, gradients, parameters, the step's device-side sums and flags). On the
// CPU backend they are the same communicator; with_device_communicators() makes the device's
// on a CUDA context: NCCL, one communicator per distinct member list.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/exec.h"
#include "parallel/communicator.h"
#include "parallel/parallel_config.h"
#include "parallel/rank_generator.h"
#include "parallel/runtime.h"

namespace moecore::parallel {

// The groups, in the order `moecore groups` prints them. Attention grid: Tp..Pp; expert grid:
// Ep..TpEpPp (Pp is the same in both).
enum class GroupKind : uint8_t {
  Tp,       // attention tensor parallel                       dims "tp"
  Cp,       // context parallel                                dims "cp"
  Dp,       // attention data parallel (dense grads w/o CP)    dims "dp"
  DpCp,     // dense grads reduce here                         dims "dp-cp"
  TpCp,     // aux-loss reduce group                           dims "tp-cp"
  TpDpCp,   // global aux loss / expert bias counts            dims "tp-cp-dp"
  Pp,       // pipeline                                        dims "pp"
  Ep,       // expert parallel: the all-to-all group           dims "ep"     (expert grid)
  ExptTp,   // tensor parallel inside experts                  dims "tp"     (expert grid)
  ExptDp,   // expert grads reduce here                        dims "dp"     (expert grid)
  TpEp,     // dispatcher's all-gather / token counts          dims "tp-ep"  (expert grid)
  TpEpPp,   // expert model parallel incl. pipeline            dims "tp-ep-pp" (expert grid)
};
inline constexpr int kNumGroupKinds = 12;
inline constexpr std::array<GroupKind, kNumGroupKinds> kAllGroupKinds = {
    GroupKind::Tp, GroupKind::Cp,     GroupKind::Dp,     GroupKind::DpCp,
    GroupKind::TpCp, GroupKind::TpDpCp, GroupKind::Pp,   GroupKind::Ep,
    GroupKind::ExptTp, GroupKind::ExptDp, GroupKind::TpEp, GroupKind::TpEpPp};

std::string_view group_name(GroupKind k);  // "tp", "dp_cp", "expt_tp", ...
std::string_view group_dims(GroupKind k);  // the RankGenerator dimensions, "tp-cp-dp", ...
bool is_expert_grid(GroupKind k);

// Every group of every rank for one layout: pure, no processes.
struct Layout {
  ParallelConfig config;
  Degrees degrees;
  std::array<RankLists, kNumGroupKinds> groups;

  const RankLists& of(GroupKind k) const { return groups[static_cast<int>(k)]; }
  // Index of the group of kind k that holds `rank`, and the rank's position in it.
  int group_index(GroupKind k, int rank) const;
  int position(GroupKind k, int rank) const;
};

// Resolves the degrees (resolve_degrees: throws on bad layouts), generates both grids and checks
// that they agree on the pipeline groups.
Layout make_layout(const ParallelConfig& cfg, int world_size);

// One group as seen by this process.
struct ProcessGroup {
  std::string name;
  std::vector<int> ranks;  // world ranks, in group order
  int rank = 0;            // this process's position in `ranks`
  // The host's communicator: host memory only. Null until connect_communicators().
  std::shared_ptr<Communicator> comm;
  // The device's communicator: the execution context's memory (with_device_communicators());
  // null where the host's serves both (the CPU backend).
  std::shared_ptr<Communicator> device_comm;

  int size() const { return static_cast<int>(ranks.size()); }
  // The host's communicator; throws naming the group when not connected.
  Communicator& communicator() const;
  // The communicator of collectives on the execution context's memory: the device's where one
  // was made, else the host's (the same memory on the CPU backend).
  Communicator& device_communicator() const;
};

class ProcessGroups {
 public:
  // This process's view of `layout` (rank lists only; no communication).
  ProcessGroups(Layout layout, int rank);

  int rank() const { return rank_; }  // world rank
  int world_size() const { return layout_.degrees.world; }
  const Layout& layout() const { return layout_; }
  const Degrees& degrees() const { return layout_.degrees; }

  ProcessGroup& group(GroupKind k) { return groups_[static_cast<int>(k)]; }
  const ProcessGroup& group(GroupKind k) const { return groups_[static_cast<int>(k)]; }
  ProcessGroup& world() { return world_; }
  const ProcessGroup& world() const { return world_; }
  ProcessGroup& tp() { return group(GroupKind::Tp); }
  ProcessGroup& cp() { return group(GroupKind::Cp); }
  ProcessGroup& dp() { return group(GroupKind::Dp); }
  ProcessGroup& dp_cp() { return group(GroupKind::DpCp); }
  ProcessGroup& tp_cp() { return group(GroupKind::TpCp); }
  ProcessGroup& tp_dp_cp() { return group(GroupKind::TpDpCp); }
  ProcessGroup& pp() { return group(GroupKind::Pp); }
  ProcessGroup& ep() { return group(GroupKind::Ep); }
  ProcessGroup& expt_tp() { return group(GroupKind::ExptTp); }
  ProcessGroup& expt_dp() { return group(GroupKind::ExptDp); }
  ProcessGroup& tp_ep() { return group(GroupKind::TpEp); }
  ProcessGroup& tp_ep_pp() { return group(GroupKind::TpEpPp); }

  // Pipeline stage of this rank, and the experts it holds: [ep_rank * E/EP, (ep_rank+1) * E/EP).
  int pp_stage() const { return group(GroupKind::Pp).rank; }
  int ep_rank() const { return group(GroupKind::Ep).rank; }

 private:
  Layout layout_;
  int rank_ = 0;
  ProcessGroup world_;
  std::array<ProcessGroup, kNumGroupKinds> groups_;
};

// Creates the world communicator and one communicator per group (collective over the world:
// every rank must call it, with the same layout). With MPI, the runtime must be initialised and
// its world size and rank must match the groups. Without MPI only a world of one process is
// possible (anything else reports "unavailable"). Collectives time out after
// config.timeout_seconds().
void connect_communicators(ProcessGroups& groups);

// A copy of `groups` (the same rank lists and host communicators) whose device communicators run
// on `ex`'s device. On the CPU backend none is made: the host's serve (the copy is the same
// groups). On CUDA, collective over the world (every rank calls it, after
// connect_communicators()): one NCCL communicator per distinct member list of more than one
// rank (the world and every group; e.g. dp and dp_cp when cp = 1 share one), bootstrapped
// through the first such group's host communicator and ordered after `ex`'s stream; a group of
// one rank gets a local communicator whose copies are ops on `ex` (device memory). Each group
// sees its shared communicator through a view of its own (its name, its call and byte
// counters), so per-group metrics do not mix. `ex` must outlive the copy.
ProcessGroups with_device_communicators(const ProcessGroups& groups, const Exec& ex);

// The usual start of a distributed run: validate the layout against the model, build the groups
// for this rank, connect them.
ProcessGroups init_process_groups(const ParallelConfig& cfg, const Runtime& rt,
                                  const ModelDims& model);

}  // namespace moecore::parallel
