// Device selection (parallel/device_assignment.h) under mpirun in the emulated CUDA build, whose
// node holds MOECORE_EMU_CUDA_DEVICES devices and applies CUDA_VISIBLE_DEVICES as the runtime
// does (tests/emu/device/device_cuda_emu.cpp). Each case is its own ctest entry with the launch it
// needs (tests/CMakeLists.txt): 2 ranks on 2 devices take devices 0 and 1; 2 ranks pinned to
// one device each take their device 0; 2 ranks landing on one GPU, and 3 ranks on 2 devices, are
// refused on every rank with the message. The emulated device's own cases run as one process.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "common/mpi_testing.h"
#include "core/check.h"
#include "core/device.h"
#include "core/exec.h"
#include "parallel/device_assignment.h"
#include "parallel/runtime.h"

namespace moecore::parallel {
namespace {

Runtime g_rt;

std::string emu_uuid(int p) {
  char tail[16];
  std::snprintf(tail, sizeof tail, "%012x", p);
  return std::string("GPU-e0000000-0000-4000-8000-") + tail;
}

// The error select_device throws here ("" when it selects).
std::string selection_error(std::ostringstream& log) {
  try {
    select_device(g_rt, Device::CUDA, log);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_contains(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& p : parts) {
    EXPECT_NE(text.find(p), std::string::npos) << "missing '" << p << "' in: " << text;
  }
}

// mpirun -np 2, MOECORE_EMU_CUDA_DEVICES=2: every rank sees both; rank r takes device r, and rank
// 0 logs one line per rank.
TEST(DeviceSelectMpi, EachRankTakesTheDeviceOfItsNodeLocalRank) {
  ASSERT_EQ(g_rt.world_size, 2) << "launch with mpirun -np 2";
  std::ostringstream log;
  ASSERT_EQ(selection_error(log), "");
  EXPECT_EQ(cuda_current_device(), g_rt.rank);
  EXPECT_EQ(cuda_visible_devices().at(cuda_current_device()).uuid, emu_uuid(g_rt.rank));
  if (g_rt.rank == 0) {
    expect_contains(log.str(),
                    {"[device] rank 0 on node '", "CUDA device 0 of 2 visible",
                     "[device] rank 1 on node '", "CUDA device 1 of 2 visible", emu_uuid(1)});
  } else {
    EXPECT_EQ(log.str(), "");  // rank 0 alone writes the lines
  }
  // Streams and allocations now live on the selected device.
  const Exec ex = make_exec(Device::CUDA);
  void* p = exec_alloc(ex, MemSpace::Device, 64);
  exec_free(ex, MemSpace::Device, p);
  EXPECT_EQ(cuda_current_device(), g_rt.rank);
}

// mpirun -np 1 -x CUDA_VISIBLE_DEVICES=1 : -np 1 -x CUDA_VISIBLE_DEVICES=0 (a launcher that pins
// one GPU per process): each sees one device and takes it.
TEST(DeviceSelectMpi, PinnedRanksTakeTheirOneDevice) {
  ASSERT_EQ(g_rt.world_size, 2) << "launch with mpirun -np 2";
  std::ostringstream log;
  ASSERT_EQ(selection_error(log), "");
  EXPECT_EQ(cuda_current_device(), 0);
  ASSERT_EQ(cuda_visible_devices().size(), 1u);
  EXPECT_EQ(cuda_visible_devices()[0].uuid, emu_uuid(g_rt.rank == 0 ? 1 : 0));
  if (g_rt.rank == 0) expect_contains(log.str(), {"CUDA device 0 of 1 visible", emu_uuid(0)});
}

// mpirun -np 1 -x CUDA_VISIBLE_DEVICES=1 : -np 1 -x CUDA_VISIBLE_DEVICES=0,1: rank 0's device 0
// and rank 1's device 1 are the same GPU.
TEST(DeviceSelectMpi, TwoRanksOnOneGpuAreRefused) {
  ASSERT_EQ(g_rt.world_size, 2) << "launch with mpirun -np 2";
  std::ostringstream log;
  const std::string error = selection_error(log);
  expect_contains(error, {"[device] node '", "ranks 0, 1 would share the same GPU " + emu_uuid(1),
                          "rank 0 as its device 0, rank 1 as its device 1",
                          "rank 0 sees 1 device (0: " + emu_uuid(1) + ")",
                          "rank 1 sees 2 devices (0: " + emu_uuid(0) + ", 1: " + emu_uuid(1),
                          "CUDA_VISIBLE_DEVICES"});
  EXPECT_EQ(log.str(), "");
}

// mpirun -np 3, MOECORE_EMU_CUDA_DEVICES=2: more processes than devices on the node.
TEST(DeviceSelectMpi, MoreRanksThanDevicesAreRefused) {
  ASSERT_EQ(g_rt.world_size, 3) << "launch with mpirun -np 3";
  std::ostringstream log;
  const std::string error = selection_error(log);
  expect_contains(error, {"runs 3 processes of --device cuda (ranks 0, 1, 2)",
                          "see only 2 CUDA devices", "Run at most 2 processes on this node"});
}

// One process. CUDA_VISIBLE_DEVICES as the runtime reads it: a list of indices or UUID prefixes
// in the order given, cut at the first entry that is not a device (or is one already listed).
TEST(EmuDevice, VisibleDevicesAsTheCudaRuntimeReadsThem) {
  ASSERT_EQ(g_rt.world_size, 1);
  setenv("MOECORE_EMU_CUDA_DEVICES", "4", 1);
  const auto seen = [](const char* visible) {
    if (visible == nullptr) {
      unsetenv("CUDA_VISIBLE_DEVICES");
    } else {
      setenv("CUDA_VISIBLE_DEVICES", visible, 1);
    }
    std::vector<std::string> uuids;
    for (const CudaDeviceId& d : cuda_visible_devices()) uuids.push_back(d.uuid);
    return uuids;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(seen(nullptr), (V{emu_uuid(0), emu_uuid(1), emu_uuid(2), emu_uuid(3)}));
  EXPECT_EQ(seen("2,0"), (V{emu_uuid(2), emu_uuid(0)}));
  EXPECT_EQ(seen(" 3 , 1"), (V{emu_uuid(3), emu_uuid(1)}));
  EXPECT_EQ(seen("1,7,0"), (V{emu_uuid(1)}));  // 7 is not a device: the list ends there
  EXPECT_EQ(seen("1,x,0"), (V{emu_uuid(1)}));
  EXPECT_EQ(seen("1,1,2"), (V{emu_uuid(1)}));
  EXPECT_EQ(seen("-1"), V{});
  EXPECT_EQ(seen(""), V{});
  EXPECT_EQ(seen(emu_uuid(3).c_str()), (V{emu_uuid(3)}));
  EXPECT_EQ(seen("2,GPU-e0000000"), (V{emu_uuid(2)}));  // a prefix of every device names none
  EXPECT_EQ(cuda_device_info().count, 1);
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  EXPECT_FALSE(cuda_device_info().available);
  unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_EQ(cuda_device_info().count, 4);
  unsetenv("MOECORE_EMU_CUDA_DEVICES");
  EXPECT_EQ(cuda_device_info().count, 8);  // the default node
}

// One process: a stream or an allocation before the selection made CUDA's context on device 0,
// where it stays: selecting another device then is an error; device 0 itself is not.
TEST(EmuDevice, SelectingAfterAContextExistsIsRefused) {
  ASSERT_EQ(g_rt.world_size, 1);
  const Exec ex = make_exec(Device::CUDA);
  void* p = exec_alloc(ex, MemSpace::Device, 64);
  exec_free(ex, MemSpace::Device, p);
  std::string error;
  try {
    cuda_select_device(1);
  } catch (const Error& e) {
    error = e.what();
  }
  expect_contains(error, {"[device] selecting device 1 after a CUDA context was created on "
                          "device 0",
                          "select the device first"});
  EXPECT_EQ(cuda_current_device(), 0);
  cuda_select_device(0);
  // And an ordinal this process does not see.
  error.clear();
  try {
    cuda_select_device(8);
  } catch (const Error& e) {
    error = e.what();
  }
  expect_contains(error, {"cudaSetDevice(8): invalid device ordinal (this process sees 8"});
}

}  // namespace
}  // namespace moecore::parallel

int main(int argc, char** argv) {
  using namespace moecore::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  g_rt = runtime_init(&argc, &argv);
  moecore::testing::quiet_gtest_on_other_ranks(g_rt.rank);
  int rc = RUN_ALL_TESTS();
  int any = rc;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  runtime_finalize();
  return any;
}
