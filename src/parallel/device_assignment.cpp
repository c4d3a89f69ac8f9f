#include "parallel/device_assignment.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>

#include "core/check.h"
#include "core/device.h"

namespace moecore::parallel {

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// What the node's processes see, ranks with the same view together: "ranks 0, 1 see 2 devices
// (0: GPU-..., 1: GPU-...); rank 2 sees none (why)".
std::string describe_views(const NodeDevices& node) {
  std::vector<bool> done(node.ranks.size(), false);
  std::string out;
  for (size_t i = 0; i < node.ranks.size(); ++i) {
    if (done[i]) continue;
    std::vector<int> same;
    for (size_t j = i; j < node.ranks.size(); ++j) {
      if (!done[j] && node.ranks[j].ids == node.ranks[i].ids) {
        done[j] = true;
        same.push_back(node.ranks[j].rank);
      }
    }
    const std::vector<std::string>& ids = node.ranks[i].ids;
    const char* verb = same.size() == 1 ? "sees" : "see";
    std::string view;
    if (ids.empty()) {
      view = fmt::format("{} no device ({})", verb,
                         node.ranks[i].why_none.empty() ? "none visible" : node.ranks[i].why_none);
    } else {
      view = fmt::format("{} {} device{}{} (", verb, ids.size(), ids.size() == 1 ? "" : "s",
                         same.size() == 1 ? "" : " each");
      for (size_t d = 0; d < ids.size(); ++d) {
        view += fmt::format("{}{}: {}", d ? ", " : "", d, ids[d]);
      }
      view += ")";
    }
    out += (out.empty() ? "" : "; ") + rank_list(same) + " " + view;
  }
  return out;
}

}  // namespace

DeviceAssignment assign_node_devices(const NodeDevices& node) {
  const int n = static_cast<int>(node.ranks.size());
  DeviceAssignment a;
  MOE_CHECK(n > 0, "[device] node '{}': no process", node.host);
  // A process without a device, then one that sees some but too few: each is the first fix.
  for (const RankDevices& r : node.ranks) {
    if (!r.ids.empty()) continue;
    a.error = fmt::format(
        "[device] node '{}': rank {} sees no CUDA device, and every process of --device cuda "
        "needs a GPU of its own. What the node's {} process{} see: {}. Check CUDA_VISIBLE_DEVICES "
        "of that rank and the driver (nvidia-smi), or train with --device cpu",
        node.host, r.rank, n, n == 1 ? "" : "es", describe_views(node));
    return a;
  }
  std::vector<int> too_few;
  int fewest = INT_MAX;
  for (const RankDevices& r : node.ranks) {
    const int k = static_cast<int>(r.ids.size());
    if (k != 1 && k < n) {
      too_few.push_back(r.rank);
      fewest = std::min(fewest, k);
    }
  }
  if (!too_few.empty()) {
    std::vector<int> all;
    for (const RankDevices& r : node.ranks) all.push_back(r.rank);
    a.error = fmt::format(
        "[device] node '{}' runs {} processes of --device cuda ({}) but {} see{} only {} CUDA "
        "devices: {}. One process per GPU: a process takes the device of its rank on the node "
        "when it sees at least as many devices as the node runs processes, or its one device when "
        "it sees exactly one. Run at most {} processes on this node (mpirun -np <GPUs per node x "
        "nodes>), or give each process its own GPU with CUDA_VISIBLE_DEVICES",
        node.host, n, rank_list(all), rank_list(too_few), too_few.size() == 1 ? "s" : "", fewest,
        describe_views(node), fewest);
    return a;
  }
  std::vector<int> ordinals(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ordinals[i] = node.ranks[i].ids.size() == 1 ? 0 : i;
  // Two processes on one physical GPU, whatever ordinals their views give it.
  for (int i = 0; i < n; ++i) {
    const std::string& id = node.ranks[i].ids[ordinals[i]];
    std::vector<int> sharing = {node.ranks[i].rank};
    std::string as = fmt::format("rank {} as its device {}", node.ranks[i].rank, ordinals[i]);
    for (int j = i + 1; j < n; ++j) {
      if (node.ranks[j].ids[ordinals[j]] != id) continue;
      sharing.push_back(node.ranks[j].rank);
      as += fmt::format(", rank {} as its device {}", node.ranks[j].rank, ordinals[j]);
    }
    if (sharing.size() == 1) continue;
    a.error = fmt::format(
        "[device] node '{}': {} would share the same GPU {} ({}). What they see: {}. One process "
        "per GPU (NCCL refuses two ranks on one GPU, and each process plans the GPU's memory as "
        "its own): give each process a different GPU with CUDA_VISIBLE_DEVICES, or run fewer "
        "processes on this node",
        node.host, rank_list(sharing), id, as, describe_views(node));
    return a;
  }
  a.ordinals = std::move(ordinals);
  return a;
}

void select_device(const Runtime& rt, Device device, std::ostream& log) {
  if (device != Device::CUDA || !cuda_built()) return;
  const std::vector<CudaDeviceId> visible = cuda_visible_devices();
  RankDevices mine;
  mine.rank = rt.rank;
  for (const CudaDeviceId& d : visible) mine.ids.push_back(d.uuid);
  if (visible.empty()) mine.why_none = cuda_device_info().description;
  int local_rank = 0;
  NodeDevices node = gather_node_devices(mine, &local_rank);
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "?");
  node.host = host;
  // One process that sees nothing: creating the context says so, as it did before selection.
  if (node.ranks.size() == 1 && visible.empty()) return;
  const DeviceAssignment a = assign_node_devices(node);
  if (!a.ok()) throw Error(a.error);
  const int ordinal = a.ordinals[static_cast<size_t>(local_rank)];
  cuda_select_device(ordinal);
  const CudaDeviceId& d = visible[static_cast<size_t>(ordinal)];
  const std::string line = fmt::format(
      "[device] rank {} on node '{}' (node-local rank {} of {}): CUDA device {} of {} "
      "visible, {} ({}, PCI {})",
      rt.rank, node.host, local_rank, node.ranks.size(), ordinal, visible.size(), d.name, d.uuid,
      d.pci_bus_id);
  for (const std::string& l : gather_lines_on_rank0(line)) log << l << "\n";
  log.flush();
}

}  // namespace moecore::parallel
