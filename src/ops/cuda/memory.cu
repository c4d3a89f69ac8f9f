// Zeroing and copying on the context's stream (ops/memory.h's CUDA paths): cudaMemsetAsync and
// cudaMemcpyAsync, the direction inferred from the addresses (unified addressing: device memory
// and pinned host memory alike); a read-back then waits for the stream, under the stream-wait
// watchdog (core/exec.h). In the grid emulator's build the same calls move host memory
// (tests/emu/cuda_emu.h).
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

namespace {
struct ReadBack {
  void* stream;
  size_t bytes;
};
bool read_back_done(void* arg) {
  const ReadBack& r = *static_cast<const ReadBack*>(arg);
  const cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(r.stream));
  if (err == cudaErrorNotReady) return false;
  check(err, "the read-back's wait", r.bytes);
  return true;
}
}  // namespace

void read_back_bytes(void* stream, void* dst, const void* src, size_t bytes) {
  copy_bytes(stream, dst, src, bytes);
  // Polled under the stream-wait watchdog (core/exec.h): a stream that never ends is reported.
  ReadBack r{stream, bytes};
  wait_for_stream("a read-back of device data (ops::read_back)", read_back_done, &r);
}

}  // namespace moecore::ops::cuda
