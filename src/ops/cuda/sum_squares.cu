// Sum of squares in f64 on the GPU, in two stages with a fixed tree: a grid of up to one wave of
// blocks (the count set by n alone), each thread adding its grid-stride elements in order (16 bytes
// of them a step: the elements before x's first 16-byte boundary and after the last whole vector
// one each, by the first threads), each block's sum by ops/cuda/reduce.cuh's fixed block tree
// into a partial in the reductions' workspace (reduce_workspace.h); then one block adds the
// partials (thread t: partials t, t + 256, ... in order; the block tree). One block alone writes
// *out itself. No atomics, so the bits depend on n, x's alignment and the values only: the same
// run to run (not the CPU fast path's bits, whose blocks and lanes differ). The ranges form runs
// both stages per non-empty range, in list order on the stream, each adding its sum into *out
// (the first onto +0): 0 + r0 + r1 + ... as the op promises, one range giving sum_squares' bits.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/cuda/reduce_workspace.h"
#include "ops/sum_squares.h"

namespace moecore::ops::cuda {

namespace {
constexpr int kBlock = 256;
// One full wave of an H100 SXM (132 SMs x 8 blocks of 256 threads): every SM streams.
constexpr int64_t kMaxBlocks = 132 * 8;
// Each thread takes at least this many elements before another block is added: a small buffer
// (most parameters' gradients) stays one block, with no second stage.
constexpr int64_t kMinElemsPerThread = 16;
}  // namespace

namespace kernels {
__device__ __forceinline__ double add_squares(double acc, float4 v) {
  const double a = v.x, b = v.y, c = v.z, d = v.w;
  return acc + a * a + b * b + c * c + d * d;
}
__device__ __forceinline__ double add_squares(double acc, double2 v) {
  return acc + v.x * v.x + v.y * v.y;
}
template <typename T>
__device__ __forceinline__ double add_square(double acc, T x) {
  const double v = static_cast<double>(x);
  return acc + v * v;
}

// Stage 1: the sum of squares of this block's grid-stride share of x[0, n): into partial[block],
// or, with one block, *out = (accumulate ? *out : 0) + sum. Dynamic shared memory: blockDim.x /
// 32 + 1 doubles. kVec: x + head is 16-byte aligned (head < 16 / sizeof(T) elements, head <= n):
// thread g adds x[g] if g < head, then the vectors g, g + stride, ... (one 16-byte load each), then
// the tail element after the last whole vector at its own index g, if any.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kBlock)
    sum_squares_partials(double* partial, double* out, const T* x, int64_t n, int head,
                         bool accumulate) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  double acc = 0;
  if constexpr (kVec) {
    using Vec = std::conditional_t<std::is_same_v<T, float>, float4, double2>;
    constexpr int64_t kLanes = int64_t(sizeof(Vec) / sizeof(T));
    if (g < head) acc = add_square(acc, x[g]);
    const int64_t n_vec = (n - head) / kLanes;
    const Vec* xv = reinterpret_cast<const Vec*>(x + head);
    for (int64_t i = g; i < n_vec; i += stride) acc = add_squares(acc, xv[i]);
    const int64_t t = head + kLanes * n_vec + g;  // the tail: fewer than kLanes elements
    if (t < n) acc = add_square(acc, x[t]);
  } else {
    for (int64_t i = g; i < n; i += stride) acc = add_square(acc, x[i]);
  }
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x != 0) return;
  if (gridDim.x == 1) {
    *out = (accumulate ? *out : 0.0) + s;
  } else {
    partial[blockIdx.x] = s;
  }
}

// Stage 2: *out = (accumulate ? *out : 0) + the sum of partial[0, blocks), one block (thread t
// adds partials t, t + blockDim.x, ... in order, then the block tree). Shared memory as stage 1's.
__global__ void __launch_bounds__(kBlock)
    sum_squares_final(double* out, const double* partial, int blocks, bool accumulate) {
  double acc = 0;
  for (int i = int(threadIdx.x); i < blocks; i += int(blockDim.x)) acc += partial[i];
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) *out = (accumulate ? *out : 0.0) + s;
}

__global__ void sum_squares_empty(double* out) {
  *out = 0.0;
}
}  // namespace kernels

namespace {
// *out = (accumulate ? *out : 0) + the sum of squares of x[0, n), n > 0.
template <typename T>
void sum_into(void* stream, double* out, const T* x, int64_t n, bool accumulate) {
  const size_t smem = size_t(kBlock / 32 + 1) * sizeof(double);
  const int64_t blocks = std::clamp<int64_t>(
      (n + kBlock * kMinElemsPerThread - 1) / (kBlock * kMinElemsPerThread), 1, kMaxBlocks);
  double* partial =
      blocks > 1 ? static_cast<double*>(reduce_workspace(stream, size_t(blocks) * sizeof(double)))
                 : nullptr;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
  if (addr % sizeof(T) == 0) {
    const int head = int(std::min<int64_t>(int64_t((16 - addr % 16) % 16 / sizeof(T)), n));
    launch("sum_squares_partials_vec", kernels::sum_squares_partials<T, true>,
           dim3(unsigned(blocks)), dim3(unsigned(kBlock)), smem, stream, partial, out, x, n, head,
           accumulate);
  } else {  // not even T-aligned: element loads only
    launch("sum_squares_partials", kernels::sum_squares_partials<T, false>, dim3(unsigned(blocks)),
           dim3(unsigned(kBlock)), smem, stream, partial, out, x, n, 0, accumulate);
  }
  if (blocks == 1) return;
  launch("sum_squares_final", kernels::sum_squares_final, dim3(1), dim3(unsigned(kBlock)), smem,
         stream, out, static_cast<const double*>(partial), int(blocks), accumulate);
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
  if (first)
    launch("sum_squares_empty", kernels::sum_squares_empty, dim3(1), dim3(1), 0, stream, out);
}

template void sum_squares<float>(void*, double*, const float*, int64_t);
template void sum_squares<double>(void*, double*, const double*, int64_t);
template void sum_squares_ranges<float>(void*, double*, const float*, const ElemRange*, int64_t);
template void sum_squares_ranges<double>(void*, double*, const double*, const ElemRange*, int64_t);

}  // namespace moecore::ops::cuda
