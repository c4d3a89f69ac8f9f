// Which ops have a CUDA path. Every build has the ops' CUDA entry points (ops::cuda::, declared
// in each op's header): the CUDA build compiles src/ops/cuda/ with nvcc; every other build
// compiles the same kernel sources as C++ against the grid emulator's interface
// (tests/emu/cuda_emu.h), so that all builds share one set of C++ objects. Without a device
// nothing launches them: the CPU build has no CUDA context (core/device_stub_cuda.cpp) and its
// launches refuse (tests/emu/emu_absent.cpp); the emulated CUDA build runs them on the CPU.
// Each op's switch (docs/design.md, "Backends"):
//   if (ex.on_cpu()) return cpu::op(...);
//   return cuda::op(ex.stream, ...);
// An op without a kernel ends its switch with no_kernel(ex, "op") instead (core/exec.h).
#pragma once

#include <span>
#include <string_view>

namespace moecore::ops {

// One op of src/ops/*.h (a function taking `const Exec&` first) and whether it runs on a CUDA
// context: its switch calls a kernel (or the CUDA runtime's copies), or it is a host-side query
// that answers for any device (a workspace size). The backend harness checks this table against
// the headers and against what the switches do (tests/backend/).
struct OpKernel {
  std::string_view op;
  bool cuda = false;
};
std::span<const OpKernel> op_kernels();

}  // namespace moecore::ops
