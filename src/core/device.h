// Accelerator discovery. Built without MOECORE_CUDA this reports "unavailable" with the reason;
// kernels for the CUDA backend live in ops/cuda/ and slot in behind the same op headers.
#pragma once

#include <string>

#include "core/exec.h"

namespace moecore {

struct DeviceInfo {
  bool available = false;
  int count = 0;
  std::string description;  // device name(s), or why none is usable
};

DeviceInfo cuda_device_info();
// A CUDA execution context on the current device with its own stream (the CUDA build);
// without it, or without a visible device, an error saying which and the fix.
Exec make_cuda_exec();

}  // namespace moecore
