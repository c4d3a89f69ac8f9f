// The multi-block reductions' scratch (reduce_workspace.h): one fixed block per stream, kept for
// the process. The CUDA build takes it with cudaMalloc on the stream's first reduction (step 1's
// backward at the latest, before any graph capture, as the cuBLAS workspace); the emulated
// builds take emulated device memory for an emulated context's stream, and host memory for the
// null stream of the grid emulator's tests (which hand kernels host buffers).
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce_workspace.h"

namespace moecore::ops::cuda {

namespace {
void* new_block(void* stream) {
#ifdef MOECORE_CUDA_EMU
  if (stream != nullptr) return ::moecore::emu::device_alloc(kReduceWorkspaceBytes, false);
  void* p = std::aligned_alloc(256, kReduceWorkspaceBytes);
  MOE_KERNEL_CHECK(p != nullptr, "[reduce] cannot allocate the " +
                                     std::to_string(kReduceWorkspaceBytes) +
                                     " bytes of the reductions' host workspace");
  return p;
#else
  (void)stream;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, kReduceWorkspaceBytes);
  MOE_KERNEL_CHECK(err == cudaSuccess,
                   "[reduce] cannot allocate the " + std::to_string(kReduceWorkspaceBytes) +
                       " bytes of the reductions' device workspace: " + cudaGetErrorString(err));
  return p;
#endif
}
}  // namespace

void* reduce_workspace(void* stream, size_t used_bytes) {
  MOE_KERNEL_CHECK(used_bytes <= kReduceWorkspaceBytes,
                   "[reduce] " + std::to_string(used_bytes) + " bytes of partials asked of the " +
                       std::to_string(kReduceWorkspaceBytes) +
                       "-byte reduction workspace (the split planning caps them below it)");
  static std::mutex mu;
  static std::map<void*, void*>* blocks = new std::map<void*, void*>();  // never freed: see above
  void* p = nullptr;
  {
    const std::lock_guard<std::mutex> lock(mu);
    auto it = blocks->find(stream);
    if (it == blocks->end()) it = blocks->emplace(stream, new_block(stream)).first;
    p = it->second;
  }
#ifdef MOECORE_CUDA_EMU
  // NaN in every float type: a partial read before it is written poisons the result.
  const ::moecore::emu::DeviceAccess access;
  std::memset(p, 0xff, used_bytes);
#endif
  return p;
}

}  // namespace moecore::ops::cuda
