#include <cuda_runtime.h>

#include "core/check.h"
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

Exec make_cuda_exec() {
  const DeviceInfo info = cuda_device_info();
  MOE_CHECK(info.available, "[exec] --device cuda: {}; use --device cpu", info.description);
  cudaStream_t stream = nullptr;
  const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  MOE_CHECK(err == cudaSuccess, "[exec] --device cuda: cudaStreamCreate failed: {}",
            cudaGetErrorString(err));
  Exec ex;
  ex.device = Device::CUDA;
  ex.stream = stream;
  return ex;
}

}  // namespace moecore
