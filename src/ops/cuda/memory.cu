// Zeroing and copying on the context's stream (ops/memory.h's CUDA paths): cudaMemsetAsync and
// cudaMemcpyAsync, the direction inferred from the addresses (unified addressing: device memory
// and pinned host memory alike); a read-back then waits for the stream. In the grid emulator's
// build the same calls move host memory (tests/emu/cuda_emu.h).
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/memory.h"

namespace moecore::ops::cuda {

namespace {
void check(cudaError_t err, const char* what, size_t bytes) {
  MOE_KERNEL_CHECK(err == cudaSuccess, std::string("[memory] ") + what + " of " +
                                           std::to_string(bytes) +
                                           " bytes failed: " + cudaGetErrorString(err));
}
}  // namespace

void zero_bytes(void* stream, void* p, size_t bytes) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync", bytes);
}

void copy_bytes(void* stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync", bytes);
}

void read_back_bytes(void* stream, void* dst, const void* src, size_t bytes) {
  copy_bytes(stream, dst, src, bytes);
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "the read-back's wait", bytes);
}

}  // namespace moecore::ops::cuda
