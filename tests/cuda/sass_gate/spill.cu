// SASS gate fixture (tests/cuda/sass_gate/test_sass_gate.sh): 64 values live at once in a kernel
// held to 32 registers per thread by __launch_bounds__(1024, 2): ptxas spills to local memory
// (STL/LDL, "bytes spill stores"). The gate must fail it.
#include <cstdint>

namespace fixture {
__global__ void __launch_bounds__(1024, 2) spill_many(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  float v[64];
#pragma unroll
  for (int k = 0; k < 64; ++k) v[k] = x[(t + k * 977) % n];
  float acc = 0.f;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
#pragma unroll
    for (int k = 0; k < 64; ++k) acc = fmaf(acc, v[(k + r) % 64], v[(k * 7 + r) % 64]);
#pragma unroll
    for (int k = 0; k < 64; ++k) v[k] = v[k] * acc + v[(k + 1) % 64];
  }
#pragma unroll
  for (int k = 0; k < 64; ++k) acc += v[k];
  y[t] = acc;
}
}  // namespace fixture
