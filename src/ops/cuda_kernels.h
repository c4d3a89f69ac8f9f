// Whether this build has CUDA kernels behind the ops' switches, and which ops have one. The CUDA
// build and the emulated CUDA build (the kernels run on the CPU through the test-only grid
// emulator, docs/testing.md) define MOECORE_HAVE_CUDA_KERNELS=1 on moecore_lib; the CPU build
// does not, so its switches name no ops::cuda:: symbol. Each op's switch (docs/design.md,
// "Backends"):
//   if (ex.on_cpu()) return cpu::op(...);
//   if constexpr (kHaveCudaKernels) return cuda::op(ex.stream, ...);  // ops with a kernel only
//   no_kernel(ex, "op");
#pragma once

#include <span>
#include <string_view>

#ifndef MOECORE_HAVE_CUDA_KERNELS
#define MOECORE_HAVE_CUDA_KERNELS 0
#endif

namespace moecore::ops {

inline constexpr bool kHaveCudaKernels = MOECORE_HAVE_CUDA_KERNELS != 0;

// One op of src/ops/*.h (a function taking `const Exec&` first) and whether it runs on a CUDA
// context in a build with kernels: its switch calls a kernel (or the CUDA runtime's copies), or it
// is a host-side query that answers for any device (a workspace size). The backend harness checks
// this table against the headers and against what the switches do (tests/backend/).
struct OpKernel {
  std::string_view op;
  bool cuda = false;
};
std::span<const OpKernel> op_kernels();

}  // namespace moecore::ops
