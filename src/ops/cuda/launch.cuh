// The one way a kernel is launched (callers write no <<<>>>): launch(name, kernel, grid, block,
// shared-memory bytes, stream, args...). In the CUDA build it is the <<<>>> launch on the stream
// followed by the launch-error check; in the grid emulator's build (tests/emu/cuda_emu.h defines
// MOECORE_CUDA_EMU) the same call runs the kernel's blocks on the CPU. Dynamic shared memory is
// read through dynamic_shared<T>(), which both builds can place.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#ifndef MOECORE_CUDA_EMU
#include <cuda_runtime.h>
#endif

namespace moecore {
// core/check.h's: throws moecore::Error. That header is not included here: fmt's compile-time
// format strings do not build under nvcc in C++20, so .cu files make their messages with
// std::string (MOE_KERNEL_CHECK).
[[noreturn]] void fail(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace moecore

// MOE_KERNEL_CHECK(n >= 0, "[add] n=" + std::to_string(n) + " < 0"): the message is built only
// when the check fails.
#define MOE_KERNEL_CHECK(cond, msg)                                 \
  do {                                                              \
    if (!(cond)) ::moecore::fail(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)

// MOE_UNROLL before a loop: nvcc's `#pragma unroll`; the grid emulator's host compiler gets GCC's
// form (a bare `#pragma unroll` is an unknown pragma to it, a -Wunknown-pragmas warning).
#ifdef MOECORE_CUDA_EMU
#define MOE_UNROLL _Pragma("GCC unroll 8")
#else
#define MOE_UNROLL _Pragma("unroll")
#endif

namespace moecore::ops::cuda {

// `name` names the kernel in errors; `stream` is the context's (Exec::stream).
template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
            void* stream, A&&... args) {
#ifdef MOECORE_CUDA_EMU
  (void)stream;
  ::moecore::emu::launch(name, kernel, grid, block, smem_bytes, std::forward<A>(args)...);
#else
  // clang-format splits the launch chevrons.
  // clang-format off
  kernel<<<grid, block, smem_bytes, static_cast<cudaStream_t>(stream)>>>(std::forward<A>(args)...);
  // clang-format on
  const cudaError_t err = cudaGetLastError();
  const auto dims = [](dim3 d) {
    return std::to_string(d.x) + "x" + std::to_string(d.y) + "x" + std::to_string(d.z);
  };
  MOE_KERNEL_CHECK(err == cudaSuccess,
                   "[cuda] launch of kernel " + std::string(name) + " (grid " + dims(grid) +
                       ", block " + dims(block) + ", " + std::to_string(smem_bytes) +
                       " bytes of dynamic shared memory) failed: " + cudaGetErrorString(err));
#endif
}

// The block's dynamic shared memory (the launch's smem_bytes, 16-byte aligned) as T[].
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
#ifdef MOECORE_CUDA_EMU
  return static_cast<T*>(::moecore::emu::detail::dynamic_shared());
#else
  extern __shared__ __align__(16) unsigned char moecore_dynamic_shared[];
  return reinterpret_cast<T*>(moecore_dynamic_shared);
#endif
}

}  // namespace moecore::ops::cuda
