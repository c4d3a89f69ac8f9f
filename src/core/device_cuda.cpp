#include <cuda_runtime.h>

#include "core/device.h"

namespace moecore {

DeviceInfo cuda_device_info() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    return DeviceInfo{false, 0, std::string("CUDA unavailable: ") + cudaGetErrorString(err)};
  }
  DeviceInfo info{n > 0, n, ""};
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      info.description += (i ? ", " : "") + std::string(prop.name);
    }
  }
  if (n == 0) info.description = "CUDA built in, but no device is visible";
  return info;
}

}  // namespace moecore
