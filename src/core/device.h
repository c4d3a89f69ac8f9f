// Accelerator discovery. Built without MOECORE_CUDA this reports "unavailable" with the reason;
// kernels for the CUDA backend live in ops/cuda/ and slot in behind the same op headers.
#pragma once

#include <string>

namespace moecore {

struct DeviceInfo {
  bool available = false;
  int count = 0;
  std::string description;  // device name(s), or why none is usable
};

DeviceInfo cuda_device_info();

}  // namespace moecore
