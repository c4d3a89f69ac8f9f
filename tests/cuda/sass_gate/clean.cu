// SASS gate fixture (tests/cuda/sass_gate/test_sass_gate.sh): a memory-bound kernel that loads
// and stores 16 bytes per access and keeps everything in registers. The gate must pass it.
#include <cstdint>

namespace fixture {
__global__ void scale_vec4(const float4* __restrict__ x, float4* __restrict__ y, float a, int64_t n4) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n4) {
    float4 v = x[i];
    v.x *= a; v.y *= a; v.z *= a; v.w *= a;
    y[i] = v;
  }
}
}  // namespace fixture
