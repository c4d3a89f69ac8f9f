// Built without MOECORE_MPI: one process, alone on its node.
#include "parallel/device_assignment.h"

namespace moecore::parallel {

NodeDevices gather_node_devices(const RankDevices& mine, int* local_rank) {
  *local_rank = 0;
  NodeDevices node;
  node.ranks.push_back(mine);
  return node;
}

std::vector<std::string> gather_lines_on_rank0(const std::string& line) {
  return {line};
}

}  // namespace moecore::parallel
