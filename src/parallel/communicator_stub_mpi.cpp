// Built without MOECORE_MPI: only a world of one process can be connected (every group is that
// one process); anything larger is unavailable.
#include "core/check.h"
#include "parallel/communicator_nccl.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

void connect_communicators(ProcessGroups& groups) {
  MOE_CHECK(groups.world_size() == 1,
            "[parallel] a world of {} ranks needs MPI, which is unavailable in this build: "
            "rebuild with -DMOECORE_MPI=ON (or run with all parallel sizes 1 and one process)",
            groups.world_size());
  groups.world().comm = make_local_communicator("world", 0);
  for (GroupKind k : kAllGroupKinds) {
    ProcessGroup& g = groups.group(k);
    g.comm = make_local_communicator(g.name, 0);
  }
}

std::unique_ptr<Communicator> duplicate_communicator(Communicator& group, std::string name) {
  MOE_CHECK(group.size() == 1,
            "[comm] group '{}' of {} members needs MPI, which is unavailable in this build",
            group.name(), group.size());
  return make_local_communicator(std::move(name), group.global_ranks()[0]);
}

}  // namespace moecore::parallel
