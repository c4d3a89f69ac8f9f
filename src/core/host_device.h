// MOE_HOST_DEVICE marks a function shared by a CUDA kernel and the CPU fast path of the same op
// (an element or row body, never the `_ref` oracle's): __host__ __device__ under nvcc, nothing in
// the C++ build (the grid emulator's tests compile the kernels as C++ too).
#pragma once

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif
