// The CUDA device of the emulated CUDA build (cmake -DMOECORE_CUDA_EMU=ON, docs/testing.md): in
// place of core/device_cuda.cpp, a "device" whose memory is the host's and whose kernels run on
// the CPU through the grid emulator (tests/emu/cuda_emu.h), each launch complete when it returns.
// Test-only: no other build links it.
#include <memory>

#include "core/check.h"
#include "core/device.h"
#include "core/host_memory.h"
#include "emu/device_memory_emu.h"

namespace moecore {

namespace {
// A stream handle that is not null (a null stream means the CPU context elsewhere).
int g_stream_tag = 0;
}  // namespace

bool cuda_built() { return true; }

DeviceInfo cuda_device_info() {
  return DeviceInfo{true, 1,
                    "emulated (the grid emulator on the CPU, host memory; no GPU: device math, "
                    "streams and timings are not a GPU's)"};
}

Exec make_cuda_exec() {
  emu::device_memory_mode();  // fixes the mode: a kernel's first host pointer is refused
  Exec ex;
  ex.device = Device::CUDA;
  ex.stream = &g_stream_tag;
  return ex;
}

void* cuda_alloc(const Exec&, MemSpace space, size_t bytes) {
  return emu::device_alloc(bytes, space == MemSpace::PinnedHost);
}

void cuda_free(const Exec&, MemSpace, void* p) { emu::device_free(p); }

void cuda_synchronize(const Exec&) {}  // every launch and copy has finished when it returns

std::unique_ptr<PhaseTimer> make_cuda_phase_timer(const Exec&, int capacity) {
  return make_host_phase_timer(capacity);
}

}  // namespace moecore
