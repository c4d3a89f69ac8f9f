// The device-selection rules (parallel/device_assignment.h) as a pure function of what a node's
// processes see: every case that takes a device, and every refusal with what its message names
// (the node, the ranks, the devices they see, the fix). Under mpirun in the emulated CUDA build:
// tests/parallel/mpi/test_device_select_mpi.cpp.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/device_assignment.h"

namespace moecore::parallel {
namespace {

std::string uuid(int p) {
  return "GPU-0000000" + std::to_string(p) + "-aaaa-bbbb-cccc-dddddddddddd";
}

// Every process of the node sees the same `count` devices (mpirun on a node of GPUs); world
// ranks from `first_rank` on.
NodeDevices node_of(int ranks, int count, int first_rank = 0) {
  NodeDevices node;
  node.host = "gpu-node-7";
  for (int r = 0; r < ranks; ++r) {
    RankDevices d;
    d.rank = first_rank + r;
    for (int p = 0; p < count; ++p) d.ids.push_back(uuid(p));
    node.ranks.push_back(d);
  }
  return node;
}

// Each process sees the physical devices listed for it (CUDA_VISIBLE_DEVICES per rank).
NodeDevices node_seeing(const std::vector<std::vector<int>>& views, int first_rank = 0) {
  NodeDevices node;
  node.host = "gpu-node-7";
  for (size_t r = 0; r < views.size(); ++r) {
    RankDevices d;
    d.rank = first_rank + static_cast<int>(r);
    for (int p : views[r]) d.ids.push_back(uuid(p));
    node.ranks.push_back(d);
  }
  return node;
}

void expect_contains(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& p : parts) {
    EXPECT_NE(text.find(p), std::string::npos) << "missing '" << p << "' in: " << text;
  }
}

TEST(DeviceAssignment, OneProcessTakesDeviceZero) {
  for (int count : {1, 2, 8}) {
    const DeviceAssignment a = assign_node_devices(node_of(1, count));
    ASSERT_TRUE(a.ok()) << a.error;
    EXPECT_EQ(a.ordinals, std::vector<int>{0}) << count << " devices";
  }
}

TEST(DeviceAssignment, EachRankTakesTheDeviceOfItsNodeLocalRank) {
  const DeviceAssignment a = assign_node_devices(node_of(4, 4, /*first_rank=*/8));
  ASSERT_TRUE(a.ok()) << a.error;
  EXPECT_EQ(a.ordinals, (std::vector<int>{0, 1, 2, 3}));
  // More devices than processes: the first ones, one each.
  const DeviceAssignment b = assign_node_devices(node_of(3, 8));
  ASSERT_TRUE(b.ok()) << b.error;
  EXPECT_EQ(b.ordinals, (std::vector<int>{0, 1, 2}));
}

TEST(DeviceAssignment, PinnedProcessesTakeTheirOneDevice) {
  // Slurm --gpus-per-task=1, or one CUDA_VISIBLE_DEVICES per rank: each sees its own GPU.
  const DeviceAssignment a = assign_node_devices(node_seeing({{3}, {1}, {0}, {2}}));
  ASSERT_TRUE(a.ok()) << a.error;
  EXPECT_EQ(a.ordinals, (std::vector<int>{0, 0, 0, 0}));
}

TEST(DeviceAssignment, MixedViewsThatLandOnDistinctGpus) {
  // Rank 0 pinned to GPU 0; rank 1 sees both and takes its node-local rank's, GPU 1.
  const DeviceAssignment a = assign_node_devices(node_seeing({{0}, {0, 1}}));
  ASSERT_TRUE(a.ok()) << a.error;
  EXPECT_EQ(a.ordinals, (std::vector<int>{0, 1}));
}

TEST(DeviceAssignment, MoreProcessesThanDevicesIsRefused) {
  const DeviceAssignment a = assign_node_devices(node_of(3, 2, /*first_rank=*/3));
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(a.ordinals.empty());
  expect_contains(
      a.error,
      {"[device] node 'gpu-node-7' runs 3 processes", "(ranks 3, 4, 5)", "only 2 CUDA devices",
       "ranks 3, 4, 5 see 2 devices each (0: " + uuid(0) + ", 1: " + uuid(1) + ")",
       "Run at most 2 processes on this node", "CUDA_VISIBLE_DEVICES"});
}

TEST(DeviceAssignment, OneRankWithTooFewDevicesIsRefused) {
  // Two processes see all four; the third sees two of them: it cannot take device 2.
  const DeviceAssignment a = assign_node_devices(node_seeing({{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1}}));
  ASSERT_FALSE(a.ok());
  expect_contains(a.error, {"but rank 2 sees only 2 CUDA devices", "ranks 0, 1 see 4 devices each",
                            "rank 2 sees 2 devices (0: " + uuid(0)});
}

TEST(DeviceAssignment, PinnedProcessesOnOneGpuAreRefused) {
  // Both given CUDA_VISIBLE_DEVICES=1, or a node of one GPU with two processes.
  const DeviceAssignment a = assign_node_devices(node_seeing({{1}, {1}}, /*first_rank=*/4));
  ASSERT_FALSE(a.ok());
  expect_contains(a.error,
                  {"[device] node 'gpu-node-7': ranks 4, 5 would share the same GPU " + uuid(1),
                   "rank 4 as its device 0, rank 5 as its device 0",
                   "ranks 4, 5 see 1 device each (0: " + uuid(1) + ")", "CUDA_VISIBLE_DEVICES",
                   "fewer processes on this node"});
}

TEST(DeviceAssignment, DifferentOrdinalsOfOneGpuAreRefused) {
  // Rank 0 sees GPU 1 alone (its device 0); rank 1 sees GPUs 0, 1 and 2 and takes its device 1;
  // rank 2 has GPU 2 to itself.
  const DeviceAssignment a = assign_node_devices(node_seeing({{1}, {0, 1, 2}, {2}}));
  ASSERT_FALSE(a.ok());
  expect_contains(a.error, {"ranks 0, 1 would share the same GPU " + uuid(1),
                            "rank 0 as its device 0, rank 1 as its device 1"});
  EXPECT_EQ(a.error.find("rank 2 as its"), std::string::npos) << a.error;
}

TEST(DeviceAssignment, AProcessThatSeesNoDeviceIsRefused) {
  NodeDevices node = node_seeing({{0}, {1}, {}});
  node.ranks[2].why_none = "CUDA built in, but no device is visible";
  const DeviceAssignment a = assign_node_devices(node);
  ASSERT_FALSE(a.ok());
  expect_contains(a.error, {"[device] node 'gpu-node-7': rank 2 sees no CUDA device",
                            "rank 2 sees no device (CUDA built in, but no device is visible)",
                            "rank 0 sees 1 device (0: " + uuid(0) + ")", "CUDA_VISIBLE_DEVICES",
                            "--device cpu"});
}

}  // namespace
}  // namespace moecore::parallel
