// Sum of squares in f64 on the GPU, in a fixed tree that needs no scratch: one block of kBlock
// threads per buffer (or range), each thread summing its block-stride elements in order (16 bytes
// of them a step where x is 16-byte aligned), then ops/cuda/reduce.cuh's fixed block tree. No
// atomics, so the bits depend on n, the alignment and the values only: the same run to run (not
// the CPU fast path's bits, whose blocks and lanes differ). The ranges form launches one such
// block per non-empty range, in list order on the stream, each adding its sum into *out (the
// first onto +0): 0 + r0 + r1 + ... as the op promises, one range giving sum_squares' bits.
// One block reads at one SM's bandwidth: the price of an op signature without planned scratch
// (the gradient norm reads each gradient once a step).
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/sum_squares.h"

namespace moecore::ops::cuda {

namespace {
constexpr int64_t kBlock = 1024;
}  // namespace

namespace kernels {
__device__ __forceinline__ double add_squares(double acc, float4 v) {
  const double a = v.x, b = v.y, c = v.z, d = v.w;
  return acc + a * a + b * b + c * c + d * d;
}
__device__ __forceinline__ double add_squares(double acc, double2 v) {
  return acc + v.x * v.x + v.y * v.y;
}

// *out = (accumulate ? *out : 0) + sum x^2 over x[0, n), one block (dynamic shared memory:
// blockDim.x / 32 + 1 doubles). vec: x is 16-byte aligned, each thread adds 16 bytes of
// elements a step (a float4 or a double2, one load) in element order, then the tail of n % lanes
// one at a time.
template <typename T, bool kVec>
__global__ void sum_squares_block(double* out, const T* x, int64_t n, bool accumulate) {
  const int64_t t = threadIdx.x, stride = blockDim.x;
  double acc = 0;
  int64_t tail = 0;
  if constexpr (kVec) {
    using Vec = std::conditional_t<std::is_same_v<T, float>, float4, double2>;
    constexpr int64_t kLanes = int64_t(sizeof(Vec) / sizeof(T));
    const int64_t n_vec = n / kLanes;
    const Vec* xv = reinterpret_cast<const Vec*>(x);
    for (int64_t i = t; i < n_vec; i += stride) acc = add_squares(acc, xv[i]);
    tail = kLanes * n_vec;
  }
  for (int64_t i = tail + t; i < n; i += stride) {
    const double v = static_cast<double>(x[i]);
    acc += v * v;
  }
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) *out = (accumulate ? *out : 0.0) + s;
}

__global__ void sum_squares_empty(double* out) { *out = 0.0; }
}  // namespace kernels

namespace {
// *out = (accumulate ? *out : 0) + the sum of squares of x[0, n), n > 0.
template <typename T>
void sum_into(void* stream, double* out, const T* x, int64_t n, bool accumulate) {
  const size_t smem = size_t(kBlock / 32 + 1) * sizeof(double);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    launch("sum_squares_block_vec", kernels::sum_squares_block<T, true>, dim3(1),
           dim3(unsigned(kBlock)), smem, stream, out, x, n, accumulate);
  } else {
    launch("sum_squares_block", kernels::sum_squares_block<T, false>, dim3(1),
           dim3(unsigned(kBlock)), smem, stream, out, x, n, accumulate);
  }
}
}  // namespace

template <typename T>
void sum_squares(void* stream, double* out, const T* x, int64_t n) {
  MOE_KERNEL_CHECK(n >= 0, "[sum_squares] n=" + std::to_string(n) + " < 0");
  if (n == 0) {
    launch("sum_squares_empty", kernels::sum_squares_empty, dim3(1), dim3(1), 0, stream, out);
    return;
  }
  sum_into(stream, out, x, n, false);
}

template <typename T>
void sum_squares_ranges(void* stream, double* out, const T* x, const ElemRange* ranges,
                        int64_t n_ranges) {
  MOE_KERNEL_CHECK(n_ranges >= 0, "[sum_squares] " + std::to_string(n_ranges) + " ranges < 0");
  for (int64_t r = 0; r < n_ranges; ++r) {  // all checked before the first launch
    MOE_KERNEL_CHECK(ranges[r].begin >= 0 && ranges[r].count >= 0,
                     "[sum_squares] range " + std::to_string(r) + ": begin " +
                         std::to_string(ranges[r].begin) + " count " +
                         std::to_string(ranges[r].count) + " (both >= 0)");
  }
  bool first = true;
  for (int64_t r = 0; r < n_ranges; ++r) {
    if (ranges[r].count == 0) continue;  // adds +0: nothing
    sum_into(stream, out, x + ranges[r].begin, ranges[r].count, !first);
    first = false;
  }
  if (first) launch("sum_squares_empty", kernels::sum_squares_empty, dim3(1), dim3(1), 0, stream, out);
}

template void sum_squares<float>(void*, double*, const float*, int64_t);
template void sum_squares<double>(void*, double*, const double*, int64_t);
template void sum_squares_ranges<float>(void*, double*, const float*, const ElemRange*, int64_t);
template void sum_squares_ranges<double>(void*, double*, const double*, const ElemRange*, int64_t);

}  // namespace moecore::ops::cuda
