#include "core/check.h"
#include "core/device.h"

namespace moecore {

bool cuda_built() { return false; }

DeviceInfo cuda_device_info() {
  return DeviceInfo{false, 0, "CUDA unavailable: moecore was built without -DMOECORE_CUDA=ON"};
}

std::vector<CudaDeviceId> cuda_visible_devices() { return {}; }

void cuda_select_device(int ordinal) {
  MOE_FAIL("[device] selecting CUDA device {}: this moecore was built without CUDA", ordinal);
}

int cuda_current_device() { return 0; }

Exec make_cuda_exec() {
  MOE_FAIL(
      "[exec] --device cuda: this moecore was built without CUDA; rebuild with "
      "cmake -DMOECORE_CUDA=ON (needs nvcc and the CUDA toolkit), or use --device cpu");
}

void* cuda_alloc(const Exec&, MemSpace space, size_t bytes) {
  MOE_FAIL("[exec] {} bytes of {} memory on a CUDA context: this moecore was built without CUDA",
           bytes, mem_space_name(space));
}

void cuda_free(const Exec&, MemSpace, void*) {}

std::unique_ptr<PhaseTimer> make_cuda_phase_timer(const Exec&, int) {
  MOE_FAIL("[profiler] CUDA events: this moecore was built without CUDA");
}

bool cuda_stream_idle(const Exec&) {
  MOE_FAIL("[exec] a CUDA stream: this moecore was built without CUDA");
}

void cuda_capture_begin(const Exec&) {
  MOE_FAIL("[cuda-graph] a CUDA graph capture: this moecore was built without CUDA");
}

void* cuda_capture_end(const Exec&, bool, int64_t*) {
  return nullptr;
}

void cuda_graph_launch(const Exec&, void*) {
  MOE_FAIL("[cuda-graph] a CUDA graph launch: this moecore was built without CUDA");
}

void cuda_graph_destroy(void*) {}

}  // namespace moecore
