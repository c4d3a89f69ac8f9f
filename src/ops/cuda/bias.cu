// The column bias on the GPU. Forward: a grid-stride loop over the elements of y, each adding its
// column's bias. Backward: reduce_cols.cuh's two-stage column reduction (blocks over splits of
// the rows, then the splits' partials in a fixed order; no atomics, so the same sums run to run,
// associated otherwise than the CPU fast path's rows in order: within the dtype's row).
#include <algorithm>

#include "ops/bias.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce_cols.cuh"

namespace moecore::ops::cuda {

namespace kernels {
template <typename T>
__global__ void bias_forward(T* y_MN, const T* b_N, int64_t MN, int64_t N) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < MN; i += stride) {
    y_MN[i] += b_N[i % N];
  }
}

// db's terms for reduce_cols.cuh: dy of row m, column n.
template <typename T>
struct BiasDbTerm {
  static constexpr int kOut = 1;
  const T* dy_MN;
  int M;
  __device__ __forceinline__ RowRange rows(int) const { return {0, M}; }
  template <int kLanes>
  __device__ __forceinline__ void add(T (&acc)[1][kLanes], size_t i, int) const {
    T dy[kLanes];
    load_lanes<kLanes>(dy_MN + i, dy);
    for (int l = 0; l < kLanes; ++l) acc[0][l] += dy[l];
  }
};
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
// A grid-stride loop beyond this many blocks: one full wave of an H200 (132 SMs x 2048 threads).
constexpr int64_t kMaxBlocks = 132 * 2048 / kBlock;
}  // namespace

template <typename T>
void bias_forward(void* stream, T* y_MN, const T* b_N, int64_t M, int64_t N) {
  MOE_KERNEL_CHECK(M >= 0 && N >= 0, "[bias_forward] negative shape M=" + std::to_string(M) +
                                         " N=" + std::to_string(N));
  const int64_t MN = M * N;
  if (MN == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = std::min((MN + kBlock - 1) / kBlock, kMaxBlocks);
  launch("bias_forward", kernels::bias_forward<T>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)),
         0, stream, y_MN, b_N, MN, N);
}

template <typename T>
void bias_backward(void* stream, T* db_N, const T* dy_MN, int64_t M, int64_t N) {
  // Checks the shape (0 to 2^31-1 each); db gains nothing from no rows or no columns.
  const ColReducePlan p = plan_col_reduce<T>(M, N, 1, "bias_backward");
  const kernels::BiasDbTerm<T> term{dy_MN, int(M)};
  T* const out[1] = {db_N};
  reduce_cols(stream, p, term, out, 1, N % kColVecLanes<T> == 0 && all_16_aligned(dy_MN),
              "bias_backward", "bias_backward_partials");
}

template void bias_forward<float>(void*, float*, const float*, int64_t, int64_t);
template void bias_forward<double>(void*, double*, const double*, int64_t, int64_t);
template void bias_backward<float>(void*, float*, const float*, int64_t, int64_t);
template void bias_backward<double>(void*, double*, const double*, int64_t, int64_t);

}  // namespace moecore::ops::cuda
