#include "core/device.h"

namespace moecore {

DeviceInfo cuda_device_info() {
  return DeviceInfo{false, 0, "CUDA unavailable: moecore was built without -DMOECORE_CUDA=ON"};
}

}  // namespace moecore
