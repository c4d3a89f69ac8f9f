// Routing replay's table copies on the GPU: a thread per id of the run (grid-stride), so a warp's
// loads and stores cover consecutive ids of consecutive tokens in both buffers; K int32 per token
// is too narrow a row for 16-byte vectors, as the other index kernels. 32-bit index math: the
// host checks that the table and the run hold fewer than 2^31 ids. Each id is written by one
// thread from its source alone: bitwise the CPU's in any order.
#include <algorithm>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/routing_table.h"

namespace moecore::ops::cuda {

namespace kernels {
// Where id i = (s * B + b) * K + k of the run lives in the table, (b * S + pos0 + s) * K + k, or
// false when its position is outside [0, S).
__device__ __forceinline__ bool table_index(uint32_t i, uint32_t B, uint32_t K, uint32_t S,
                                            int64_t pos0, uint32_t* j) {
  const uint32_t t = i / K, k = i - t * K;
  const uint32_t s = t / B, b = t - s * B;
  const int64_t pos = pos0 + int64_t(s);
  if (pos < 0 || pos >= int64_t(S)) return false;
  *j = (b * S + uint32_t(pos)) * K + k;
  return true;
}

// n = rows * B * K ids.
__global__ void routing_table_store(int32_t* table, const int32_t* local_TK, uint32_t B,
                                    uint32_t S, uint32_t K, int64_t pos0, uint32_t n) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint32_t j = 0;
    if (table_index(i, B, K, S, pos0, &j)) table[j] = local_TK[i];
  }
}

__global__ void routing_table_load(int32_t* local_TK, const int32_t* table, uint32_t B,
                                   uint32_t S, uint32_t K, int64_t pos0, uint32_t n) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint32_t j = 0;
    local_TK[i] = table_index(i, B, K, S, pos0, &j) ? table[j] : -1;
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill a GPU
constexpr int64_t kMax32 = 0x7fffffff;

// check_routing_table_args's checks, with messages built without fmt.
void check_args(int64_t B, int64_t S, int64_t K, int64_t rows, const char* op) {
  const std::string shape = std::string("[") + op + "] B=" + std::to_string(B) +
                            " S=" + std::to_string(S) + " K=" + std::to_string(K) +
                            " rows=" + std::to_string(rows);
  MOE_KERNEL_CHECK(S >= 0 && rows >= 0 && B >= 0 && K >= 1,
                   shape + ": bad shape: the micro-batch's samples, the sequence length and the "
                           "run's rows must be >= 0, K (the router's top-k) >= 1");
  MOE_KERNEL_CHECK(B * S * K <= kMax32 && rows * B * K <= kMax32,
                   shape + ": the table or the run holds 2^31 ids or more: lower "
                           "--micro-batch-size or --seq-length");
}

template <bool kStore>
void copy_launch(void* stream, int32_t* dst, const int32_t* src, int64_t B, int64_t S, int64_t K,
                 int64_t rows, int64_t pos0, const char* op) {
  check_args(B, S, K, rows, op);
  const int64_t n = rows * B * K;
  if (n == 0) return;  // a grid of no blocks is a launch error
  const dim3 grid{unsigned(std::min(kMaxBlocks, (n + kBlock - 1) / kBlock))};
  const dim3 block{unsigned(kBlock)};
  using U = uint32_t;
  if constexpr (kStore)
    launch(op, kernels::routing_table_store, grid, block, 0, stream, dst, src, U(B), U(S), U(K),
           pos0, U(n));
  else
    launch(op, kernels::routing_table_load, grid, block, 0, stream, dst, src, U(B), U(S), U(K),
           pos0, U(n));
}
}  // namespace

void routing_table_store(void* stream, int32_t* table_BSK, const int32_t* local_TK, int64_t B,
                         int64_t S, int64_t K, int64_t rows, int64_t pos0) {
  copy_launch<true>(stream, table_BSK, local_TK, B, S, K, rows, pos0, "routing_table_store");
}

void routing_table_load(void* stream, int32_t* local_TK, const int32_t* table_BSK, int64_t B,
                        int64_t S, int64_t K, int64_t rows, int64_t pos0) {
  copy_launch<false>(stream, local_TK, table_BSK, B, S, K, rows, pos0, "routing_table_load");
}

}  // namespace moecore::ops::cuda
