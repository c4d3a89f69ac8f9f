// SASS gate fixture (tests/cuda/sass_gate/test_sass_gate.sh): marked memory-bound in the fixture
// rules, but it loads 4 bytes per access (LDG.E, no LDG.E.128). The gate must fail it.
#include <cstdint>

namespace fixture {
__global__ void scale_scalar(const float* __restrict__ x, float* __restrict__ y, float a, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i];
}
}  // namespace fixture
