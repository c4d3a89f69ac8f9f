// CUDA graphs of a context's stream (core/stream_graph.h) on the device this build has: the
// emulated device in the emulated CUDA build (scripts/emu_cuda.sh runs CudaGraph.*), a GPU in the
// CUDA build (skipped without one), nothing on the CPU build (the capture is refused there).
// A captured sequence of ops replays to the eager bits and follows new inputs copied into its
// buffers; a host read, a stream synchronisation and an allocation inside the captured region
// are refused naming the call, and the stream is usable afterwards.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/check.h"
#include "core/device.h"
#include "core/stream_graph.h"
#include "ops/add.h"
#include "ops/gemm.h"
#include "ops/memory.h"

namespace moecore {
namespace {

bool have_cuda_device() {
  return cuda_built() && cuda_device_info().available;
}

// The buffers of a small step: x, w in; y = x w^T, then y += x0 (an add), and a scale of one
// element from memory.
struct Step {
  explicit Step(const Exec& e) : ex(e), arena(e, MemSpace::Device), host(e, MemSpace::PinnedHost) {
    arena.plan([this](Arena& a) {
      x = a.alloc<float>(kM * kK, "x");
      w = a.alloc<float>(kN * kK, "w");
      y = a.alloc<float>(kM * kN, "y");
      b = a.alloc<float>(kM * kN, "b");
    });
    host.plan([this](Arena& a) {
      hx = a.alloc_host<float>(kM * kK, "hx");
      hy = a.alloc_host<float>(kM * kN, "hy");
    });
    std::vector<float> hw(kN * kK), hb(kM * kN);
    for (int64_t i = 0; i < kN * kK; ++i) hw[i] = float((i * 5) % 13) / 8.0f - 0.75f;
    for (int64_t i = 0; i < kM * kN; ++i) hb[i] = 0.125f * float(i % 9);
    ops::copy<float>(ex, w, hw.data(), kN * kK);
    ops::copy<float>(ex, b, hb.data(), kM * kN);
    exec_synchronize(ex);
  }
  // The inputs of one step into the pinned staging, then onto the device (outside any graph).
  void inputs(float shift) {
    for (int64_t i = 0; i < kM * kK; ++i) hx[i] = 0.5f * float(i % 7) - shift;
    ops::copy<float>(ex, x, hx, kM * kK);
  }
  // The work a graph captures: the GEMM, the add, the copy back to pinned staging.
  void work() {
    ops::linear_forward<float>(ex, y, x, w, kM, kN, kK);
    ops::add<float>(ex, y, y, b, kM * kN);
    ops::copy<float>(ex, hy, y, kM * kN);
  }
  std::vector<float> result() {
    exec_synchronize(ex);
    return std::vector<float>(hy, hy + kM * kN);
  }
  static constexpr int64_t kM = 6, kN = 5, kK = 8;
  Exec ex;
  Arena arena, host;
  DevPtr<float> x = nullptr, w = nullptr, y = nullptr, b = nullptr;
  float* hx = nullptr;
  float* hy = nullptr;
};

TEST(CudaGraph, ReplayEqualsTheEagerStepAndFollowsNewInputs) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device (emulated or real) in this build";
  const Exec ex = make_cuda_exec();
  Step s(ex);
  s.inputs(1.0f);
  s.work();  // the warm-up: the GEMM's algorithm is chosen here
  const std::vector<float> eager = s.result();
  StreamGraph g = StreamGraph::capture(ex, "test step", [&] { s.work(); });
  EXPECT_FALSE(g.empty());
  EXPECT_GE(g.operations(), 3);
  for (float shift : {1.0f, -2.5f}) {
    s.inputs(shift);
    s.work();
    const std::vector<float> want = s.result();
    ops::zero<float>(ex, s.y, Step::kM * Step::kN);  // no value of the eager run left to copy
    s.inputs(shift);
    std::fill(s.hy, s.hy + Step::kM * Step::kN, -1.0f);
    g.launch();
    const std::vector<float> got = s.result();
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
        << "the replay differs from the eager step (shift " << shift << ")";
    if (shift == 1.0f) {
      EXPECT_EQ(got, eager);
    }
  }
}

// Each refusal names the call, and the stream captures and runs again afterwards.
void expect_refused(const std::function<void(Step&)>& planted, const std::string& want) {
  const Exec ex = make_cuda_exec();
  Step s(ex);
  s.inputs(0.5f);
  s.work();
  const std::vector<float> eager = s.result();
  try {
    StreamGraph g = StreamGraph::capture(ex, "test step", [&] {
      s.work();
      planted(s);
    });
    ADD_FAILURE() << "captured; wanted a refusal naming: " << want;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[cuda-graph]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("inside the captured test step"), std::string::npos) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
  StreamGraph g = StreamGraph::capture(ex, "test step", [&] { s.work(); });
  std::fill(s.hy, s.hy + Step::kM * Step::kN, -1.0f);
  g.launch();
  EXPECT_EQ(s.result(), eager) << "after a refused capture";
}

TEST(CudaGraph, AHostReadInsideTheCaptureIsRefusedByName) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device (emulated or real) in this build";
  expect_refused(
      [](Step& s) { (void)ops::read_value<float>(s.ex, DevPtr<const float>(s.y)); },
      "a host sync inside the captured test step: ops::read_back: the host reads device data");
}

TEST(CudaGraph, AStreamSynchronizationInsideTheCaptureIsRefused) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device (emulated or real) in this build";
  expect_refused([](Step& s) { exec_synchronize(s.ex); },
                 "exec_synchronize: the host waits for the stream");
}

TEST(CudaGraph, AnAllocationInsideTheCaptureIsRefused) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device (emulated or real) in this build";
  expect_refused(
      [](Step& s) {
        void* p = exec_alloc(s.ex, MemSpace::Device, 4096);
        exec_free(s.ex, MemSpace::Device, p);
      },
      "a device allocation inside the captured test step: 4096 bytes of device memory "
      "(exec_alloc)");
}

// The CPU backend has no stream: a capture there is refused, naming the region.
TEST(CudaGraph, TheCpuBackendHasNothingToCapture) {
  try {
    StreamGraph::capture(cpu_exec(), "test step", [] {});
    ADD_FAILURE() << "captured on the CPU backend";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capturing test step on the CPU backend: it has no "
                                         "stream to capture"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moecore
