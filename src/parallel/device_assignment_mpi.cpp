// The MPI half of device selection: what each process sees, gathered over the processes of its
// node (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED: the processes that share memory, whatever
// launched them, mpirun, srun or another PMI launcher), and the chosen devices' lines on rank 0.
#include <mpi.h>

#include <string>
#include <vector>

#include "parallel/device_assignment.h"
#include "parallel/mpi_check.h"

namespace moecore::parallel {

namespace {

bool mpi_up() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  return inited != 0 && finalized == 0;
}

// Every process's `text` on every process of `comm` (root < 0) or on `root` alone, in rank order.
std::vector<std::string> gather_text(MPI_Comm comm, const std::string& text, int root,
                                     const char* what) {
  int rank = 0, size = 1;
  MOE_CHECK_MPI(MPI_Comm_rank(comm, &rank), "[device] {}: MPI_Comm_rank", what);
  MOE_CHECK_MPI(MPI_Comm_size(comm, &size), "[device] {}: MPI_Comm_size", what);
  const int len = static_cast<int>(text.size());
  std::vector<int> lens(static_cast<size_t>(size)), offsets(static_cast<size_t>(size));
  if (root < 0) {
    MOE_CHECK_MPI(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm),
                  "[device] {}: MPI_Allgather of the lengths", what);
  } else {
    MOE_CHECK_MPI(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, root, comm),
                  "[device] {}: MPI_Gather of the lengths", what);
  }
  int total = 0;
  for (int r = 0; r < size; ++r) {
    offsets[r] = total;
    total += lens[r];
  }
  std::vector<char> all(static_cast<size_t>(total) + 1);
  if (root < 0) {
    MOE_CHECK_MPI(MPI_Allgatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(),
                                 offsets.data(), MPI_CHAR, comm),
                  "[device] {}: MPI_Allgatherv", what);
  } else {
    MOE_CHECK_MPI(MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), offsets.data(),
                              MPI_CHAR, root, comm),
                  "[device] {}: MPI_Gatherv", what);
    if (rank != root) return {};
  }
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.emplace_back(all.data() + offsets[r], lens[r]);
  return out;
}

// One process's view as lines: its rank, the reason it sees none, then one id per line.
std::string encode(const RankDevices& d) {
  std::string s = std::to_string(d.rank) + "\n" + d.why_none;
  for (const std::string& id : d.ids) s += "\n" + id;
  return s;
}

RankDevices decode(const std::string& s) {
  std::vector<std::string> lines;
  size_t at = 0;
  while (true) {
    const size_t nl = s.find('\n', at);
    lines.push_back(s.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  RankDevices d;
  d.rank = std::stoi(lines.at(0));
  d.why_none = lines.at(1);
  d.ids.assign(lines.begin() + 2, lines.end());
  return d;
}

}  // namespace

NodeDevices gather_node_devices(const RankDevices& mine, int* local_rank) {
  NodeDevices node;
  *local_rank = 0;
  if (!mpi_up()) {
    node.ranks.push_back(mine);
    return node;
  }
  int world_rank = 0;
  MOE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "[device] MPI_Comm_rank");
  // Keyed by the world rank: node-local ranks follow the world's order on each node.
  MPI_Comm shm = MPI_COMM_NULL;
  MOE_CHECK_MPI(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &shm),
      "[device] MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): the processes of this node");
  MOE_CHECK_MPI(MPI_Comm_set_errhandler(shm, MPI_ERRORS_RETURN),
                "[device] MPI_Comm_set_errhandler");
  MOE_CHECK_MPI(MPI_Comm_rank(shm, local_rank), "[device] MPI_Comm_rank of the node");
  const std::vector<std::string> views =
      gather_text(shm, encode(mine), -1, "the devices each process of the node sees");
  MPI_Comm_free(&shm);
  for (const std::string& v : views) node.ranks.push_back(decode(v));
  return node;
}

std::vector<std::string> gather_lines_on_rank0(const std::string& line) {
  if (!mpi_up()) return {line};
  return gather_text(MPI_COMM_WORLD, line, 0, "the chosen devices");
}

}  // namespace moecore::parallel
