// The CUDA device of the emulated CUDA build (cmake -DMOECORE_CUDA_EMU=ON, docs/testing.md): in
// place of core/device_cuda.cpp, a "device" whose memory is the host's and whose kernels run on
// the CPU through the grid emulator (tests/emu/cuda_emu.h), each launch complete when it returns.
// A node holds MOECORE_EMU_CUDA_DEVICES such devices (8 unless set), each with its own UUID, and
// CUDA_VISIBLE_DEVICES picks among them as the CUDA runtime does, so that device selection under
// mpirun (parallel/device_assignment.h) runs here as on a node of GPUs.
// Test-only: no other build links it.
#include <cctype>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/check.h"
#include "core/device.h"
#include "core/fault_injection.h"
#include "core/host_memory.h"
#include "emu/device_memory_emu.h"
#include "emu/stream_capture_emu.h"

namespace moecore {

namespace {
// A stream handle that is not null (a null stream means the CPU context elsewhere).
int g_stream_tag = 0;
// The process's current device (cudaSetDevice's) and the device its context lives on: -1 until
// a selection, a stream or an allocation creates it (CUDA's primary context, made on the current
// device, 0 unless selected).
int g_current = 0;
int g_context = -1;

constexpr int kDefaultDevices = 8;

// The emulated node's devices: MOECORE_EMU_CUDA_DEVICES, or 8 (enough for CI's multi-rank runs
// on one machine).
int physical_devices() {
  const char* v = std::getenv("MOECORE_EMU_CUDA_DEVICES");
  if (v == nullptr || *v == '\0') return kDefaultDevices;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  MOE_CHECK(*end == '\0' && n >= 0 && n <= 64,
            "[device] MOECORE_EMU_CUDA_DEVICES={}: the emulated node's device count is a number "
            "from 0 to 64",
            v);
  return static_cast<int>(n);
}

// Physical device p's identity: the same in every process of the node, as a GPU's is.
std::string emu_uuid(int p) {
  return fmt::format("GPU-e0000000-0000-4000-8000-{:012x}", p);
}

std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

// The physical devices this process sees, in ordinal order. CUDA_VISIBLE_DEVICES unset: all of
// them. Set: a comma list of indices or UUIDs (a prefix of one that names a single device, as the
// runtime accepts "GPU-e0000000"); the devices listed before the first entry that is invalid
// (not a device of the node, or listed already) are visible, the rest of the list is ignored,
// as the CUDA runtime does. An empty variable hides every device. Read at each query (the
// runtime reads it once, when it starts): the emulator's tests change it between cases.
std::vector<int> visible_physical() {
  const int n = physical_devices();
  std::vector<int> out;
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (env == nullptr) {
    for (int p = 0; p < n; ++p) out.push_back(p);
    return out;
  }
  std::string_view rest = env;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string entry = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    int p = -1;
    if (!entry.empty() && entry.find_first_not_of("0123456789") == std::string::npos) {
      const long v = entry.size() <= 6 ? std::strtol(entry.c_str(), nullptr, 10) : n;
      if (v < n) p = static_cast<int>(v);
    } else if (entry.rfind("GPU-", 0) == 0) {
      for (int q = 0; q < n; ++q) {
        if (emu_uuid(q).rfind(entry, 0) != 0) continue;
        if (p >= 0) {  // a prefix of two devices names neither
          p = -1;
          break;
        }
        p = q;
      }
    }
    bool listed = false;
    for (int q : out) listed = listed || q == p;
    if (p < 0 || listed) break;
    out.push_back(p);
  }
  return out;
}

// The first stream or allocation creates the context on the current device, as CUDA's runtime
// does implicitly.
void touch_context() {
  if (g_context < 0) g_context = g_current;
}
}  // namespace

bool cuda_built() {
  return true;
}

DeviceInfo cuda_device_info() {
  const int n = static_cast<int>(visible_physical().size());
  if (n == 0) {
    return DeviceInfo{false, 0,
                      fmt::format("CUDA built in, but no device is visible (emulated: "
                                  "MOECORE_EMU_CUDA_DEVICES={}, CUDA_VISIBLE_DEVICES='{}')",
                                  physical_devices(),
                                  std::getenv("CUDA_VISIBLE_DEVICES") != nullptr
                                      ? std::getenv("CUDA_VISIBLE_DEVICES")
                                      : "")};
  }
  return DeviceInfo{true, n,
                    "emulated (the grid emulator on the CPU, host memory; no GPU: device math, "
                    "streams and timings are not a GPU's)"};
}

std::vector<CudaDeviceId> cuda_visible_devices() {
  std::vector<CudaDeviceId> out;
  for (int p : visible_physical()) {
    out.push_back(CudaDeviceId{fmt::format("emulated CUDA device {}", p), emu_uuid(p),
                               fmt::format("0000:{:02x}:00.0", p + 1)});
  }
  return out;
}

void cuda_select_device(int ordinal) {
  const int n = static_cast<int>(visible_physical().size());
  MOE_CHECK(ordinal >= 0 && ordinal < n,
            "[device] cudaSetDevice({}): invalid device ordinal (this process sees {} devices)",
            ordinal, n);
  // CUDA would leave the earlier context where it is, holding memory on that GPU (device 0 of
  // every process that did it): the emulated device makes it an error.
  MOE_CHECK(g_context < 0 || g_context == ordinal,
            "[device] selecting device {} after a CUDA context was created on device {} (a "
            "stream or an allocation came before the selection): select the device first",
            ordinal, g_context);
  g_current = ordinal;
  g_context = ordinal;
}

int cuda_current_device() {
  return g_current;
}

Exec make_cuda_exec() {
  const DeviceInfo info = cuda_device_info();
  MOE_CHECK(info.available, "[exec] --device cuda: {}; use --device cpu", info.description);
  touch_context();
  emu::device_memory_mode();  // fixes the mode: a kernel's first host pointer is refused
  Exec ex;
  ex.device = Device::CUDA;
  ex.stream = &g_stream_tag;
  return ex;
}

void* cuda_alloc(const Exec&, MemSpace space, size_t bytes) {
  touch_context();
  return emu::device_alloc(bytes, space == MemSpace::PinnedHost);
}

void cuda_free(const Exec&, MemSpace, void* p) {
  emu::device_free(p);
}

// Every launch and copy has finished when it returns, so the stream is idle; unless MOECORE_FAULT
// holds "stream_hang" (optional device=D, this process's device ordinal; iter=N, the trainer's
// step, fault::iteration()): there it never is, as a GPU's stream behind a kernel that does not
// end (the stream-wait watchdog's test: core/exec.h).
bool cuda_stream_idle(const Exec&) {
  for (const fault::Fault& f : fault::injected()) {
    if (f.kind != "stream_hang") continue;
    const int64_t device = f.int_arg("device", -1);
    if ((device < 0 || device == g_current) && f.matches(-1, fault::iteration())) return false;
  }
  return true;
}

std::unique_ptr<PhaseTimer> make_cuda_phase_timer(const Exec&, int capacity) {
  return make_host_phase_timer(capacity);
}

// CUDA graphs: the emulator's recorder (tests/emu/stream_capture_emu.h).
void cuda_capture_begin(const Exec&) {
  emu::capture_begin();
}

void* cuda_capture_end(const Exec&, bool keep, int64_t* operations) {
  return emu::capture_end(keep, operations);
}

void cuda_graph_launch(const Exec&, void* graph) {
  emu::graph_replay(*static_cast<const emu::Graph*>(graph));
}

void cuda_graph_destroy(void* graph) {
  emu::graph_destroy(static_cast<emu::Graph*>(graph));
}

}  // namespace moecore
