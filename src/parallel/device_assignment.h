// Which GPU each process takes: one process per GPU, by its rank among the processes of its node
// (MPI's shared-memory communicator, whatever launched them), chosen before anything creates a
// CUDA context. The rules are a pure function of what the node's processes see
// (assign_node_devices); gathering that over MPI is a thin layer beside it
// (gather_node_devices, device_assignment_mpi.cpp).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "core/exec.h"
#include "parallel/runtime.h"

namespace moecore::parallel {

// What one process of a node sees.
struct RankDevices {
  int rank = 0;                  // in the world
  std::vector<std::string> ids;  // each visible device's physical identity (UUID), by ordinal
  std::string why_none;          // with no visible device: the runtime's reason
};

// The processes of one node, in node-local rank order.
struct NodeDevices {
  std::string host;
  std::vector<RankDevices> ranks;
};

// The device ordinal each node-local rank takes, or why the node's processes cannot each have a
// GPU of their own (ordinals empty).
struct DeviceAssignment {
  std::vector<int> ordinals;
  std::string error;
  bool ok() const { return error.empty(); }
};

// The rules, the same on every process of the node (so all agree without talking again):
// - a process that sees exactly one device takes it (ordinal 0): a launcher that pins one GPU
//   per process (Slurm's --gpus-per-task, a CUDA_VISIBLE_DEVICES per rank);
// - a process that sees at least as many devices as the node runs processes takes the device of
//   its node-local rank (mpirun on a node whose GPUs every process sees);
// - otherwise (a process sees no device, or more than one but fewer than the node's processes),
//   or when two processes would land on the same physical GPU (the same UUID), an error naming
//   the node, the ranks, the devices each sees, and the fix.
DeviceAssignment assign_node_devices(const NodeDevices& node);

// Collective over the world: every process reports what it sees (ids, why_none) to the processes
// of its node and gets theirs, in node-local rank order; `local_rank` is this process's place.
// One process without MPI (or before MPI is up): a node of one. device_assignment_mpi.cpp.
NodeDevices gather_node_devices(const RankDevices& mine, int* local_rank);
// Collective over the world: every process's `line`, in rank order, on rank 0 (empty elsewhere).
std::vector<std::string> gather_lines_on_rank0(const std::string& line);

// Selects this process's CUDA device for `device` (nothing for the CPU, or without the CUDA
// build, where creating the context says what is missing): gathers the node's view, applies
// assign_node_devices, calls cuda_select_device, and rank 0 writes one line per rank to `log`
// (rank, host, ordinal, name, UUID). Collective over the world. Call it first, before anything
// creates a stream or allocates: a CUDA context made before stays on device 0. Throws the
// assignment's error on every process of a node that cannot be assigned. A single process that
// sees no device selects nothing (make_exec then says so, as before).
void select_device(const Runtime& rt, Device device, std::ostream& log);

}  // namespace moecore::parallel
