// Element-wise sum of two tensors (residual connections, the shared expert's output added to the
// routed one): y = a + b. y may alias a or b. Exact per element, so fast == reference bitwise.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "core/host_device.h"

namespace moecore::ops {

// The element body of the CPU fast path and the CUDA kernel (never of add_ref).
template <typename T>
MOE_HOST_DEVICE inline T add_element(T a, T b) {
  return a + b;
}

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void add(T* y, const T* a, const T* b, int64_t n);
}  // namespace cpu
// The CUDA kernels (ops/cuda/: the CUDA build, the emulated CUDA build and the grid emulator's
// tests); `stream` is the context's. The switch below calls them where the build has kernels.
namespace cuda {
template <typename T>
void add(void* stream, T* y, const T* a, const T* b, int64_t n);
}  // namespace cuda

template <typename T>
void add(const Exec& ex, DevPtr<T> y, DevPtr<const T> a, DevPtr<const T> b, int64_t n) {
  if (ex.on_cpu()) return cpu::add(raw_ptr(y), raw_ptr(a), raw_ptr(b), n);
  return cuda::add(ex.stream, raw_ptr(y), raw_ptr(a), raw_ptr(b), n);
}
template <typename T>
void add_ref(T* y, const T* a, const T* b, int64_t n);

}  // namespace moecore::ops
