#include "core/check.h"
#include "core/device.h"

namespace moecore {

DeviceInfo cuda_device_info() {
  return DeviceInfo{false, 0, "CUDA unavailable: moecore was built without -DMOECORE_CUDA=ON"};
}

Exec make_cuda_exec() {
  MOE_FAIL(
      "[exec] --device cuda: this moecore was built without CUDA; rebuild with "
      "cmake -DMOECORE_CUDA=ON (needs nvcc and the CUDA toolkit), or use --device cpu");
}

}  // namespace moecore
