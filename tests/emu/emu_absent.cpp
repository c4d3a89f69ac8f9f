// The grid emulator's entry points in the CPU build, which has no CUDA device. Every build but
// the CUDA one compiles the kernels of src/ops/cuda/ as C++ against the emulator's interface
// (tests/emu/cuda_emu.h), so the CPU build's objects are the emulated CUDA build's
// (ops/cuda_kernels.h); the CPU build links these instead of the emulator (tests/emu/cuda_emu.cpp,
// device_memory_emu.cpp, blas_emu.cpp). Nothing reaches them in a run (no CUDA context exists:
// core/device_stub_cuda.cpp); a context made by hand that does stops at its first launch, copy or
// library call, naming it. A binary that links the emulator (test_emu) defines every symbol here
// itself, so this object is never pulled into it from moecore_lib.
#include "core/check.h"
#include "emu/cuda_emu.h"
#include "emu/device_memory_emu.h"
#include "ops/cuda/blas.h"

namespace moecore {
namespace {
[[noreturn]] void no_device(const std::string& what) {
  MOE_FAIL("[cuda] {}: this moecore was built without CUDA (no device to run it on); rebuild "
           "with -DMOECORE_CUDA=ON, or use --device cpu",
           what);
}
}  // namespace

namespace emu {

void* device_alloc(size_t, bool) { no_device("an allocation of device memory"); }
void device_free(void*) { no_device("a release of device memory"); }
DeviceAccess::DeviceAccess() { no_device("a copy or set of device memory"); }
DeviceAccess::~DeviceAccess() = default;
void check_pending(const char*, const void*, size_t, bool) {
  no_device("a copy or set of device memory");
}
void check_kernel_pointer(const char* kernel, int, const void*, bool) {
  no_device(std::string("kernel ") + kernel);
}

// No capture is ever open without a device.
bool capturing() {
  return false;
}
void record(const char* what, std::function<void()>) {
  no_device(std::string("recording ") + what);
}
void check_capturable_range(const char* who, const void*, size_t) {
  no_device(who);
}
void stream_synchronize() {
  no_device("cudaStreamSynchronize");
}

namespace detail {
// Inside a kernel body only, which no launch here ever runs.
const uint3& thread_idx() { no_device("threadIdx"); }
const uint3& block_idx() { no_device("blockIdx"); }
const dim3& block_dim() { no_device("blockDim"); }
const dim3& grid_dim() { no_device("gridDim"); }
void* dynamic_shared() { no_device("dynamic shared memory"); }
void sync_threads(const std::source_location&) { no_device("__syncthreads"); }
uint64_t warp_collective(Collective, unsigned, uint64_t, int, int, const std::source_location&) {
  no_device("a warp collective");
}
void launch(const char* name, dim3, dim3, size_t, void (*)(void*), void*) {
  no_device(std::string("kernel ") + name);
}
}  // namespace detail

}  // namespace emu

namespace ops::cuda {

struct BlasHandles {};
BlasHandles& blas_handles(const Exec&) { no_device("a cuBLAS call"); }
void run_matmul(const Exec&, const desc::LtMatmulDesc&, const void*, const void*, void*,
                BlasHandles&) {
  no_device("a cuBLASLt matmul");
}
void run_grouped_batched(const Exec&, const desc::GroupedBatchedDesc&, const void*, const void*,
                         void*, BlasHandles&) {
  no_device("a cuBLAS grouped GEMM");
}

}  // namespace ops::cuda
}  // namespace moecore
