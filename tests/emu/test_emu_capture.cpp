// Stream capture on the emulated device (tests/emu/stream_capture_emu.h, behind
// core/stream_graph.h): a captured sequence of launches, a set, copies and a cuBLASLt matmul runs
// nothing while it is recorded, and its replay equals the same sequence run eagerly, bitwise,
// reading device memory as it is at each replay (a kernel argument passed by value stays what it
// was at the capture). What a graph cannot contain stops the capture, naming it: a device
// allocation, a host read of device memory (a host sync), the host waiting for the stream, a copy
// from pageable host memory. Each test runs in a child process of its own (the device memory's
// mode is fixed at a process's first allocation: strict, as the emulated device's).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/sync_audit.h"
#include "emu/cuda_emu.h"
#include "emu/device_memory_emu.h"
#include "emu/stream_capture_emu.h"
#include "ops/cuda/launch.cuh"
#include "ops/gemm.h"
#include "ops/memory.h"

namespace moecore {
namespace {

using ops::cuda::launch;

// y = a x + y (a by value: frozen at capture).
__global__ void axpy(float a, const float* x, float* y, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) y[i] = a * x[i] + y[i];
}

// y *= *s (s read from device memory when the kernel runs).
__global__ void scale_by(const float* s, float* y, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) y[i] *= *s;
}

constexpr int kN = 48;  // a 6 x 8 matrix
constexpr size_t kBytes = kN * sizeof(float);

struct Buffers {
  float* x = nullptr;  // [kN]
  float* s = nullptr;  // [1]
  float* y = nullptr;  // [kN]
  float* w = nullptr;  // [8 x 8]
  float* z = nullptr;  // [6 x 8] = y w^T
  Buffers() {
    x = static_cast<float*>(emu::device_alloc(kBytes, false));
    s = static_cast<float*>(emu::device_alloc(sizeof(float), false));
    y = static_cast<float*>(emu::device_alloc(kBytes, false));
    w = static_cast<float*>(emu::device_alloc(64 * sizeof(float), false));
    z = static_cast<float*>(emu::device_alloc(kBytes, false));
  }
  // Host values in, through copies (strict mode: the host cannot touch device memory).
  void set(float scale, float shift) {
    std::vector<float> hx(kN), hw(64);
    for (int i = 0; i < kN; ++i) hx[i] = 0.25f * float(i) - shift;
    for (int i = 0; i < 64; ++i) hw[i] = float((i * 7) % 11) / 8.0f - 0.5f;
    ops::cuda::copy_bytes(nullptr, x, hx.data(), kBytes);
    ops::cuda::copy_bytes(nullptr, s, &scale, sizeof(float));
    ops::cuda::copy_bytes(nullptr, w, hw.data(), 64 * sizeof(float));
    std::vector<float> marker(kN, -7.0f);
    ops::cuda::copy_bytes(nullptr, y, marker.data(), kBytes);
    ops::cuda::copy_bytes(nullptr, z, marker.data(), kBytes);
  }
  std::vector<float> result() const {
    std::vector<float> out(2 * kN);
    ops::cuda::read_back_bytes(nullptr, out.data(), y, kBytes);
    ops::cuda::read_back_bytes(nullptr, out.data() + kN, z, kBytes);
    return out;
  }
};

// The sequence: a set, a copy, two launches, a matmul through the emulated cuBLASLt.
void sequence(const Buffers& b, float a) {
  ops::cuda::zero_bytes(nullptr, b.y, kBytes);
  ops::cuda::copy_bytes(nullptr, b.y, b.x, kBytes);  // device to device
  launch("axpy", axpy, dim3(2), dim3(32), 0, nullptr, a, b.x, b.y, kN);
  launch("scale_by", scale_by, dim3(1), dim3(64), 0, nullptr, b.s, b.y, kN);
  ops::cuda::linear_forward<float>(cpu_exec(), b.z, b.y, b.w, 6, 8, 8, false);
}

// Captures fn as core/stream_graph.h does: the emulator records, the sync audit's capture rules
// are armed; an error inside ends both and propagates.
emu::Graph* capture(const std::function<void()>& fn, int64_t* ops) {
  emu::capture_begin();
  SyncAudit::instance().begin_capture("test region");
  try {
    fn();
  } catch (...) {
    SyncAudit::instance().end_capture();
    emu::capture_end(false, nullptr);
    throw;
  }
  SyncAudit::instance().end_capture();
  return emu::capture_end(true, ops);
}

// Runs body in this child; an Error is printed and exits 3, a failed check exits 1.
void child(const std::function<bool()>& body) {
  setenv("MOECORE_EMU_DEVICE_MEMORY", "strict", 1);
  try {
    std::exit(body() ? 0 : 1);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::fflush(stderr);
    std::exit(3);
  }
}

class EmuCapture : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

bool replay_equals_eager() {
  Buffers b;
  b.set(1.5f, 2.0f);
  sequence(b, 3.0f);
  const std::vector<float> eager = b.result();

  b.set(1.5f, 2.0f);
  const int64_t launches_before = emu::stats().launches;
  int64_t ops = 0;
  emu::Graph* g = capture([&] { sequence(b, 3.0f); }, &ops);
  bool ok = ops == 5;  // set, copy, two launches, the matmul
  if (!ok) std::fprintf(stderr, "captured %lld operations, not 5\n", static_cast<long long>(ops));
  // Nothing ran: the outputs still hold the marker, no kernel launched.
  const std::vector<float> untouched = b.result();
  for (float v : untouched) ok = ok && v == -7.0f;
  ok = ok && emu::stats().launches == launches_before;
  if (!ok) std::fprintf(stderr, "the capture ran something\n");
  emu::graph_replay(*g);
  const std::vector<float> replayed = b.result();
  if (std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(float)) != 0) {
    std::fprintf(stderr, "the replay differs from the eager sequence\n");
    ok = false;
  }
  // New inputs in the captured buffers: the replay reads them (x and the scale in memory); the
  // by-value 3.0 stays as captured.
  b.set(-0.75f, 1.0f);
  sequence(b, 3.0f);
  const std::vector<float> eager2 = b.result();
  b.set(-0.75f, 1.0f);
  emu::graph_replay(*g);
  const std::vector<float> replayed2 = b.result();
  if (std::memcmp(replayed2.data(), eager2.data(), eager2.size() * sizeof(float)) != 0 ||
      eager2 == eager) {
    std::fprintf(stderr, "the second replay does not follow the new inputs\n");
    ok = false;
  }
  emu::graph_destroy(g);
  return ok;
}

TEST_F(EmuCapture, ReplayEqualsTheEagerSequenceBitwise) {
  EXPECT_EXIT(child(replay_equals_eager), ::testing::ExitedWithCode(0), "");
}

bool allocation_in_capture() {
  Buffers b;
  b.set(1.0f, 0.0f);
  capture(
      [&] {
        sequence(b, 1.0f);
        emu::device_alloc(256, false);  // what cudaMalloc inside a capture would be
      },
      nullptr);
  return false;
}

TEST_F(EmuCapture, AnAllocationIsRefusedNamingIt) {
  EXPECT_EXIT(child(allocation_in_capture), ::testing::ExitedWithCode(3),
              "a device allocation inside the captured test region: 256 bytes of emulated device "
              "memory \\(cudaMalloc\\)");
}

bool host_read_in_capture() {
  Buffers b;
  b.set(1.0f, 0.0f);
  Exec ex;
  ex.device = Device::CUDA;
  capture(
      [&] {
        sequence(b, 1.0f);
        (void)ops::read_value<float>(ex, DevPtr<const float>(b.y));
      },
      nullptr);
  return false;
}

TEST_F(EmuCapture, AHostReadIsRefusedNamingIt) {
  EXPECT_EXIT(child(host_read_in_capture), ::testing::ExitedWithCode(3),
              "a host sync inside the captured test region: ops::read_back: the host reads "
              "device data");
}

bool stream_sync_in_capture() {
  Buffers b;
  b.set(1.0f, 0.0f);
  capture(
      [&] {
        sequence(b, 1.0f);
        cudaStreamSynchronize(nullptr);
      },
      nullptr);
  return false;
}

TEST_F(EmuCapture, AStreamSynchronizationIsRefused) {
  EXPECT_EXIT(child(stream_sync_in_capture), ::testing::ExitedWithCode(3),
              "cudaStreamSynchronize: the host waits for the stream");
}

bool pageable_copy_in_capture() {
  Buffers b;
  b.set(1.0f, 0.0f);
  std::vector<float> host(kN, 1.0f);
  capture([&] { ops::cuda::copy_bytes(nullptr, b.y, host.data(), kBytes); }, nullptr);
  return false;
}

TEST_F(EmuCapture, ACopyFromPageableHostMemoryIsRefused) {
  EXPECT_EXIT(child(pageable_copy_in_capture), ::testing::ExitedWithCode(3),
              "cudaMemcpyAsync \\(a copy's source\\) of 192 bytes .* during a stream capture: it "
              "is pageable host memory");
}

}  // namespace
}  // namespace moecore
