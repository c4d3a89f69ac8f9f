// Sum of squares in f64 on the GPU, in a fixed two-pass tree: pass 1 has a number of blocks that
// depends on n (and x's 16-byte alignment) alone, each thread summing its grid-stride elements in
// order (16 bytes of them a step where x is 16-byte aligned: memory-bound), each block reducing
// by ops/cuda/reduce.cuh's fixed tree into one partial; pass 2 is one block that sums the partials
// the same way. No atomics, so the bits depend on n, the alignment and the values only: the same
// run to run (not the CPU fast path's bits, whose blocks and lanes differ). The ranges form sums
// each range so (one range: sum_squares' bits), then adds the range sums in list order on one
// thread.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce.cuh"
#include "ops/sum_squares.h"

namespace moecore::ops::cuda {

namespace {
constexpr int64_t kBlock = 256;
// Pass 1's blocks at most: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;
}  // namespace

namespace kernels {
// partial[blockIdx.x] = this block's share of sum x^2 (dynamic shared memory: kBlock / 32 + 1
// doubles): each thread adds its grid-stride elements in order, one at a time.
template <typename T>
__global__ void sum_squares_partials(double* partial, const T* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  double acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = static_cast<double>(x[i]);
    acc += v * v;
  }
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__device__ __forceinline__ double add_squares(double acc, float4 v) {
  const double a = v.x, b = v.y, c = v.z, d = v.w;
  return acc + a * a + b * b + c * c + d * d;
}
__device__ __forceinline__ double add_squares(double acc, double2 v) {
  return acc + v.x * v.x + v.y * v.y;
}

// The same with x 16-byte aligned: each thread adds 16 bytes of elements a step (a float4 or a
// double2, one 16-byte load), in element order, then the tail of n % kLanes one at a time.
template <typename T>
__global__ void sum_squares_partials_vec(double* partial, const T* x, int64_t n) {
  using Vec = std::conditional_t<std::is_same_v<T, float>, float4, double2>;
  constexpr int64_t kLanes = int64_t(sizeof(Vec) / sizeof(T));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = n / kLanes;
  const Vec* xv = reinterpret_cast<const Vec*>(x);
  double acc = 0;
  for (int64_t i = t; i < n_vec; i += stride) acc = add_squares(acc, xv[i]);
  for (int64_t i = kLanes * n_vec + t; i < n; i += stride) {
    const double v = static_cast<double>(x[i]);
    acc += v * v;
  }
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// *out = the sum of partial[0, n) (one block; shared memory as above).
__global__ void sum_partials(double* out, const double* partial, int64_t n) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  const double s = block_sum(acc, dynamic_shared<double>());
  if (threadIdx.x == 0) *out = s;
}

// *out = 0 + sums[0] + sums[1] + ... in order (one thread).
__global__ void add_in_order(double* out, const double* sums, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += sums[i];
  *out = s;
}
}  // namespace kernels

namespace {
// *dst = the sum of squares of x[0, n), n > 0, through `partials` (kMaxBlocks doubles).
template <typename T>
void sum_into(void* stream, double* dst, const T* x, int64_t n, double* partials) {
  const size_t smem = size_t(kBlock / 32 + 1) * sizeof(double);
  int64_t blocks = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t steps = std::max<int64_t>(n / int64_t(16 / sizeof(T)), 1);  // >= 1: the tail's
    blocks = std::min((steps + kBlock - 1) / kBlock, kMaxBlocks);
    launch("sum_squares_partials_vec", kernels::sum_squares_partials_vec<T>, dim3(unsigned(blocks)),
           dim3(unsigned(kBlock)), smem, stream, partials, x, n);
  } else {
    blocks = std::min((n + kBlock - 1) / kBlock, kMaxBlocks);
    launch("sum_squares_partials", kernels::sum_squares_partials<T>, dim3(unsigned(blocks)),
           dim3(unsigned(kBlock)), smem, stream, partials, x, n);
  }
  launch("sum_squares_sum_partials", kernels::sum_partials, dim3(1), dim3(unsigned(kBlock)), smem,
         stream, dst, static_cast<const double*>(partials), blocks);
}
}  // namespace

int64_t sum_squares_scratch_size(int64_t n_ranges) {
  return kMaxBlocks + std::max<int64_t>(n_ranges, 0);
}

template <typename T>
void sum_squares(void* stream, double* out, const T* x, int64_t n, double* scratch) {
  MOE_KERNEL_CHECK(n >= 0, "[sum_squares] n=" + std::to_string(n) + " < 0");
  if (n == 0) {
    launch("sum_squares_zero", kernels::add_in_order, dim3(1), dim3(1), 0, stream, out,
           static_cast<const double*>(nullptr), int64_t(0));
    return;
  }
  sum_into(stream, out, x, n, scratch);
}

template <typename T>
void sum_squares_ranges(void* stream, double* out, const T* x, const ElemRange* ranges,
                        int64_t n_ranges, double* scratch) {
  MOE_KERNEL_CHECK(n_ranges >= 0, "[sum_squares] " + std::to_string(n_ranges) + " ranges < 0");
  double* sums = scratch + kMaxBlocks;  // the non-empty ranges' sums, in list order
  int64_t n_sums = 0;
  for (int64_t r = 0; r < n_ranges; ++r) {
    MOE_KERNEL_CHECK(ranges[r].begin >= 0 && ranges[r].count >= 0,
                     "[sum_squares] range " + std::to_string(r) + ": begin " +
                         std::to_string(ranges[r].begin) + " count " +
                         std::to_string(ranges[r].count) + " (both >= 0)");
    if (ranges[r].count == 0) continue;  // adds +0: nothing
    sum_into(stream, sums + n_sums, x + ranges[r].begin, ranges[r].count, scratch);
    ++n_sums;
  }
  launch("sum_squares_add_ranges", kernels::add_in_order, dim3(1), dim3(1), 0, stream, out,
         static_cast<const double*>(sums), n_sums);
}

template void sum_squares<float>(void*, double*, const float*, int64_t, double*);
template void sum_squares<double>(void*, double*, const double*, int64_t, double*);
template void sum_squares_ranges<float>(void*, double*, const float*, const ElemRange*, int64_t,
                                        double*);
template void sum_squares_ranges<double>(void*, double*, const double*, const ElemRange*, int64_t,
                                         double*);

}  // namespace moecore::ops::cuda
