// Accelerator discovery. Built without MOECORE_CUDA this reports "unavailable" with the reason;
// kernels for the CUDA backend live in ops/cuda/ and slot in behind the same op headers.
#pragma once

#include <memory>
#include <string>
#include <vector>

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

// One CUDA device as this process sees it: its ordinal is its place among the devices that
// CUDA_VISIBLE_DEVICES leaves visible (the runtime applies the variable), while the UUID and the
// PCI bus id name the physical GPU, whatever ordinal it has in this or another process.
struct CudaDeviceId {
  std::string name;
  std::string uuid;        // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints
  std::string pci_bus_id;  // "0000:3b:00.0"
};
// The devices visible to this process, in ordinal order, read from the runtime's device
// properties without creating a context on any of them; empty when none is (cuda_device_info
// says why) or without the CUDA build.
std::vector<CudaDeviceId> cuda_visible_devices();
// Makes `ordinal` this process's device (cudaSetDevice, which creates its context): every later
// stream, allocation and library handle lives there. Call it before anything else touches CUDA:
// a context made earlier stays on device 0, taking memory there on every process of the node
// (the emulated device refuses it). Without the CUDA build: an error.
void cuda_select_device(int ordinal);
// The device this process's CUDA work goes to (cudaGetDevice; 0 until one is selected).
int cuda_current_device();
// A CUDA execution context on the current device with its own stream (the CUDA build);
// without it, or without a visible device, an error saying which and the fix.
Exec make_cuda_exec();
// Device memory (cudaMalloc) or pinned host memory (cudaMallocHost) for exec_alloc, zero-filled
// before it returns; and its release. The CUDA build only (without it: an error).
void* cuda_alloc(const Exec& ex, MemSpace space, size_t bytes);
void cuda_free(const Exec& ex, MemSpace space, void* p);
// Whether ex's stream has run everything enqueued on it (cudaStreamQuery; the emulated device:
// always, unless MOECORE_FAULT plants a stream that never ends); throws naming the error of a
// failed stream. exec_synchronize polls it under the stream-wait watchdog.
bool cuda_stream_idle(const Exec& ex);
// CUDA graphs of ex's stream (core/stream_graph.h calls these; the CUDA build and the emulated
// device have them, without the CUDA build they are errors). Begin: the stream starts capturing
// (cudaStreamBeginCapture, global mode). End: the capture stops (cudaStreamEndCapture); with
// `keep`, the graph is instantiated (cudaGraphInstantiate) and returned, *operations set to its
// node count; without, it is discarded (the capture failed) and null returned, never throwing.
// Launch: one replay on ex's stream (cudaGraphLaunch). Destroy: an instantiated graph (null: none).
void cuda_capture_begin(const Exec& ex);
void* cuda_capture_end(const Exec& ex, bool keep, int64_t* operations);
void cuda_graph_launch(const Exec& ex, void* graph);
void cuda_graph_destroy(void* graph);
// The phase profiler's timer on ex's stream: a planned pool of `capacity` CUDA events, one
// recorded per phase boundary, read after the stream ran them (cudaEventElapsedTime).
std::unique_ptr<PhaseTimer> make_cuda_phase_timer(const Exec& ex, int capacity);

}  // namespace moecore
