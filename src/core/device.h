// Accelerator discovery. Built without MOECORE_CUDA this reports "unavailable" with the reason;
// kernels for the CUDA backend live in ops/cuda/ and slot in behind the same op headers.
#pragma once

#include <string>

#include <memory>

#include "core/exec.h"
#include "core/profiler.h"

namespace moecore {

struct DeviceInfo {
  bool available = false;
  int count = 0;
  std::string description;  // device name(s), or why none is usable
};

// Whether this moecore was built with the CUDA backend (cmake -DMOECORE_CUDA=ON): a function,
// not a macro, so only the CUDA translation units differ between the CPU and CUDA builds.
bool cuda_built();
DeviceInfo cuda_device_info();
// A CUDA execution context on the current device with its own stream (the CUDA build);
// without it, or without a visible device, an error saying which and the fix.
Exec make_cuda_exec();
// Device memory (cudaMalloc) or pinned host memory (cudaMallocHost) for exec_alloc, zero-filled
// before it returns; and its release. The CUDA build only (without it: an error).
void* cuda_alloc(const Exec& ex, MemSpace space, size_t bytes);
void cuda_free(const Exec& ex, MemSpace space, void* p);
void cuda_synchronize(const Exec& ex);  // cudaStreamSynchronize of ex's stream
// The phase profiler's timer on ex's stream: a planned pool of `capacity` CUDA events, one
// recorded per phase boundary, read after the stream ran them (cudaEventElapsedTime).
std::unique_ptr<PhaseTimer> make_cuda_phase_timer(const Exec& ex, int capacity);

}  // namespace moecore
