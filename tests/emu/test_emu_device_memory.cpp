// The emulated device memory (device_memory_emu.h) in strict mode: a host read or write of device
// memory outside a kernel, a copy or a library call stops the process naming the access; a host
// pointer handed to a kernel is an error naming the kernel and the argument; kernels and copies
// reach device memory; pinned memory stays the host's; the buffers of collectives in flight are
// guarded; shared mode lets all of it through. Each
// test runs in a child process of its own (the mode is fixed at a process's first allocation).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "emu/cuda_emu.h"
#include "emu/device_memory_emu.h"
#include "ops/add.h"
#include "ops/memory.h"

namespace moecore {
namespace {

// Each test's body runs in a fresh process (gtest's threadsafe death tests re-execute the binary)
// and sets MOECORE_EMU_DEVICE_MEMORY before its first allocation.
class EmuDeviceMemory : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

void set_mode(const char* mode) {
  setenv("MOECORE_EMU_DEVICE_MEMORY", mode, 1);
}

// a + b on the device: the inputs copied in, the sum read back.
std::vector<float> add_on_device(const std::vector<float>& a, const std::vector<float>& b) {
  const size_t n = a.size(), bytes = n * sizeof(float);
  auto* da = static_cast<float*>(emu::device_alloc(bytes, false));
  auto* db = static_cast<float*>(emu::device_alloc(bytes, false));
  auto* dy = static_cast<float*>(emu::device_alloc(bytes, false));
  ops::cuda::copy_bytes(nullptr, da, a.data(), bytes);
  ops::cuda::copy_bytes(nullptr, db, b.data(), bytes);
  ops::cuda::add<float>(nullptr, dy, da, db, int64_t(n));
  std::vector<float> y(n);
  ops::cuda::read_back_bytes(nullptr, y.data(), dy, bytes);
  emu::device_free(da);
  emu::device_free(db);
  emu::device_free(dy);
  return y;
}

void copy_add_read_back() {
  set_mode("strict");
  const std::vector<float> y = add_on_device({1, 2, 3}, {10, 20, 30});
  const bool ok = emu::device_memory_mode() == emu::DeviceMemoryMode::Strict &&
                  y == std::vector<float>{11, 22, 33};
  std::exit(ok ? 0 : 1);
}

TEST_F(EmuDeviceMemory, KernelsAndCopiesReachDeviceMemory) {
  EXPECT_EXIT(copy_add_read_back(), ::testing::ExitedWithCode(0), "");
}

void host_writes_device() {
  set_mode("strict");
  auto* p = static_cast<float*>(emu::device_alloc(100, false));
  p[3] = 1.0f;  // what ops::copy is for
}

TEST_F(EmuDeviceMemory, HostWriteOfDeviceMemoryStopsNamingTheAccess) {
  EXPECT_DEATH(
      host_writes_device(),
      "the host touched emulated device memory at 0x[0-9a-f]+ \\(byte 12 of a device allocation "
      "of 100 bytes\\)");
}

void host_reads_device() {
  set_mode("strict");
  auto* p = static_cast<volatile float*>(emu::device_alloc(8, false));
  std::exit(p[1] == 0.0f ? 0 : 1);
}

TEST_F(EmuDeviceMemory, HostReadOfDeviceMemoryStops) {
  EXPECT_DEATH(host_reads_device(), "the host touched emulated device memory");
}

void kernel_takes_host_pointer() {
  set_mode("strict");
  auto* dy = static_cast<float*>(emu::device_alloc(3 * sizeof(float), false));
  std::vector<float> host_a(3, 1.0f);
  try {
    ops::cuda::add<float>(nullptr, dy, host_a.data(), dy, 3);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(7);
  }
  std::exit(0);
}

TEST_F(EmuDeviceMemory, HostPointerHandedToAKernelIsAnError) {
  EXPECT_EXIT(kernel_takes_host_pointer(), ::testing::ExitedWithCode(7),
              "kernel add: pointer argument 1 \\(0x[0-9a-f]+\\) points into no device or pinned "
              "allocation");
}

void pinned_host_and_kernel() {
  set_mode("strict");
  auto* pin = static_cast<float*>(emu::device_alloc(2 * sizeof(float), true));
  pin[0] = 2.0f;  // the host writes pinned memory
  pin[1] = 5.0f;
  ops::cuda::add<float>(nullptr, pin, pin, pin, 2);  // and a kernel reads it
  std::exit(pin[0] == 4.0f && pin[1] == 10.0f ? 0 : 1);
}

TEST_F(EmuDeviceMemory, PinnedMemoryIsTheHostsAndTheKernels) {
  EXPECT_EXIT(pinned_host_and_kernel(), ::testing::ExitedWithCode(0), "");
}

void shared_mode_host_access() {
  set_mode("shared");
  auto* p = static_cast<float*>(emu::device_alloc(2 * sizeof(float), false));
  p[0] = 3.0f;
  std::vector<float> host(2, 1.0f);
  ops::cuda::add<float>(nullptr, p, p, host.data(), 1);
  std::exit(p[0] == 4.0f && emu::device_memory_mode() == emu::DeviceMemoryMode::Shared ? 0 : 1);
}

TEST_F(EmuDeviceMemory, SharedModeIsHostMemory) {
  EXPECT_EXIT(shared_mode_host_access(), ::testing::ExitedWithCode(0), "");
}

void unknown_mode() {
  set_mode("loose");
  try {
    emu::device_alloc(8, false);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(7);
  }
  std::exit(0);
}

TEST_F(EmuDeviceMemory, AnUnknownModeIsAnError) {
  EXPECT_EXIT(unknown_mode(), ::testing::ExitedWithCode(7),
              "MOECORE_EMU_DEVICE_MEMORY=loose: strict .* or shared");
}

// The collectives in flight (the emulated NCCL's strict rules, device_memory_emu.h): a kernel
// pointer into a pending receive range is a missing wait, a non-const one into a pending send
// range an early reuse, a const one there is a read and allowed; copies and sets are checked over
// their bytes; nothing once the ranges are ended. Failures are printed, the count is the exit code.
void pending_ranges() {
  set_mode("strict");
  const size_t n = 64, bytes = n * sizeof(float);
  auto* a = static_cast<float*>(emu::device_alloc(bytes, false));
  auto* b = static_cast<float*>(emu::device_alloc(bytes, false));
  auto* y = static_cast<float*>(emu::device_alloc(bytes, false));
  const uint64_t recv = emu::pending_begin(a + 8, 16 * sizeof(float), emu::PendingUse::Recv,
                                           "all_reduce on group 'tp'");
  const uint64_t send =
      emu::pending_begin(b, bytes, emu::PendingUse::Send, "all_gather on group 'dp'");
  int fails = 0;
  const auto error = [&](const char* what, const auto& f, const char* part) {
    try {
      f();
      std::fprintf(stderr, "%s: no error\n", what);
      ++fails;
    } catch (const Error& e) {
      if (std::strstr(e.what(), part) == nullptr) {
        std::fprintf(stderr, "%s: '%s' not in %s\n", what, part, e.what());
        ++fails;
      }
    }
  };
  const auto fine = [&](const char* what, const auto& f) {
    try {
      f();
    } catch (const Error& e) {
      std::fprintf(stderr, "%s: %s\n", what, e.what());
      ++fails;
    }
  };
  error(
      "kernel reads the recv range", [&] { ops::cuda::add<float>(nullptr, y, a + 10, b, 4); },
      "missing wait");
  error(
      "kernel writes the recv range", [&] { ops::cuda::add<float>(nullptr, a + 23, y, y, 1); },
      "all_reduce on group 'tp'");
  error(
      "kernel writes the send range", [&] { ops::cuda::add<float>(nullptr, b + 5, y, y, 4); },
      "send buffer reused before the collective completed");
  error(
      "copy overlapping the recv range", [&] { ops::cuda::copy_bytes(nullptr, y, a, bytes); },
      "missing wait");
  error(
      "set inside the send range", [&] { ops::cuda::zero_bytes(nullptr, b + 60, 16); },
      "all_gather on group 'dp'");
  fine("kernel reads the send range", [&] { ops::cuda::add<float>(nullptr, y, b, b, n); });
  fine("copy beside the recv range", [&] { ops::cuda::copy_bytes(nullptr, y, a, 8 * 4); });
  fine("kernel past the recv range", [&] { ops::cuda::add<float>(nullptr, a + 24, y, y, 40); });
  emu::pending_end(recv);
  emu::pending_end(send);
  fine("kernel reads the ended recv range", [&] { ops::cuda::add<float>(nullptr, y, a, b, n); });
  fine("kernel writes the ended send range", [&] { ops::cuda::add<float>(nullptr, b, a, a, n); });
  // What a collective may be handed: device memory, whole.
  std::vector<float> host(4);
  auto* pinned = static_cast<float*>(emu::device_alloc(bytes, true));
  error(
      "host buffer",
      [&] { emu::check_collective_buffer("send on group 'pp'", "data", host.data(), 16); },
      "argument 'data' (");
  error(
      "pinned buffer",
      [&] { emu::check_collective_buffer("send on group 'pp'", "data", pinned, 16); },
      "is pinned host memory");
  error(
      "past the end",
      [&] { emu::check_collective_buffer("recv on group 'pp'", "data", a + 60, 32); },
      "running past the end of its device allocation");
  fine("device buffer",
       [&] { emu::check_collective_buffer("recv on group 'pp'", "data", a, bytes); });
  std::exit(fails);
}

TEST_F(EmuDeviceMemory, CollectivesInFlightGuardTheirBuffers) {
  EXPECT_EXIT(pending_ranges(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace moecore
