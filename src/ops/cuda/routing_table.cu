// Routing replay's table copies on the GPU: a thread per id of the run (grid-stride), so a warp's
// loads and stores cover consecutive ids of consecutive tokens in both buffers; K int32 per token
// is too narrow a row for 16-byte vectors, as the other index kernels. 32-bit index math where
// the run and the table hold < 2^31 ids (every real shape), 64-bit beyond. sample0 is read from
// device memory inside the kernel, as the op's contract says. Each id is written by one thread
// from its source alone: bitwise the CPU's in any order.
#include <algorithm>
#include <string>

#include "ops/cuda/launch.cuh"
#include "ops/routing_table.h"

namespace moecore::ops::cuda {

namespace kernels {
// Where id i = (s * B + b) * K + k of the run lives in the table ((sample0 + b) * S + pos0 + s)
// * K + k, or false when its token is outside the table. The range test is 64-bit (sample0 and
// pos0 are any int64); an index inside the table fits I.
template <typename I>
__device__ __forceinline__ bool table_index(I i, I B, I K, int64_t sample0, int64_t samples,
                                            int64_t S, int64_t pos0, I* j) {
  const I t = i / K, k = i - t * K;
  const I s = t / B, b = t - s * B;
  const int64_t sample = sample0 + int64_t(b), pos = pos0 + int64_t(s);
  if (sample < 0 || sample >= samples || pos < 0 || pos >= S) return false;
  *j = (I(sample) * I(S) + I(pos)) * K + k;
  return true;
}

// n = rows * B * K ids.
template <typename I>
__global__ void routing_table_store(int32_t* table, const int32_t* local_TK,
                                    const DropoutCounters* counters, int64_t samples, int64_t S,
                                    I B, I K, int64_t pos0, I n) {
  const int64_t sample0 = counters->sample0;
  const I stride = I(gridDim.x) * I(blockDim.x);
  for (I i = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); i < n; i += stride) {
    I j = 0;
    if (table_index(i, B, K, sample0, samples, S, pos0, &j)) table[j] = local_TK[i];
  }
}

template <typename I>
__global__ void routing_table_load(int32_t* local_TK, const int32_t* table,
                                   const DropoutCounters* counters, int64_t samples, int64_t S, I B,
                                   I K, int64_t pos0, I n) {
  const int64_t sample0 = counters->sample0;
  const I stride = I(gridDim.x) * I(blockDim.x);
  for (I i = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); i < n; i += stride) {
    I j = 0;
    local_TK[i] = table_index(i, B, K, sample0, samples, S, pos0, &j) ? table[j] : -1;
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill a GPU
constexpr int64_t kMax32 = 0x7fffffff;

// check_routing_table_args's checks; counters is a device pointer here, tested for null only.
void check_args(const DropoutCounters* counters, int64_t samples, int64_t S, int64_t rows,
                int64_t B, int64_t K, const char* op) {
  MOE_KERNEL_CHECK(samples >= 0 && S >= 0 && rows >= 0 && B >= 0 && K >= 1,
                   std::string("[") + op + "] bad shape samples=" + std::to_string(samples) +
                       " S=" + std::to_string(S) + " rows=" + std::to_string(rows) +
                       " B=" + std::to_string(B) + " K=" + std::to_string(K) +
                       ": the table's samples and sequence length, the run's rows and the "
                       "micro-batch must be >= 0, K (the router's top-k) >= 1");
  MOE_KERNEL_CHECK(counters != nullptr,
                   std::string("[") + op +
                       "] no counters: pass the micro-batch's DropoutCounters (its sample0 places "
                       "the run's samples in the table), written before the step");
}

// Both kernels, 32-bit where the run's ids and the table's fit int32.
template <bool kStore>
void copy_launch(void* stream, int32_t* dst, const int32_t* src, const DropoutCounters* counters,
                 int64_t samples, int64_t S, int64_t rows, int64_t B, int64_t K, int64_t pos0,
                 const char* op) {
  check_args(counters, samples, S, rows, B, K, op);
  const int64_t n = rows * B * K;
  if (n == 0) return;  // a grid of no blocks is a launch error
  const dim3 grid{unsigned(std::min(kMaxBlocks, (n + kBlock - 1) / kBlock))};
  const dim3 block{unsigned(kBlock)};
  if (n <= kMax32 && samples * S * K <= kMax32) {
    using I = uint32_t;
    if constexpr (kStore)
      launch(op, kernels::routing_table_store<I>, grid, block, 0, stream, dst, src, counters,
             samples, S, I(B), I(K), pos0, I(n));
    else
      launch(op, kernels::routing_table_load<I>, grid, block, 0, stream, dst, src, counters,
             samples, S, I(B), I(K), pos0, I(n));
    return;
  }
  if constexpr (kStore)
    launch(op, kernels::routing_table_store<int64_t>, grid, block, 0, stream, dst, src, counters,
           samples, S, B, K, pos0, n);
  else
    launch(op, kernels::routing_table_load<int64_t>, grid, block, 0, stream, dst, src, counters,
           samples, S, B, K, pos0, n);
}
}  // namespace

void routing_table_store(void* stream, int32_t* table, const int32_t* local_TK,
                         const DropoutCounters* counters, int64_t samples, int64_t S, int64_t rows,
                         int64_t B, int64_t K, int64_t pos0) {
  copy_launch<true>(stream, table, local_TK, counters, samples, S, rows, B, K, pos0,
                    "routing_table_store");
}

void routing_table_load(void* stream, int32_t* local_TK, const int32_t* table,
                        const DropoutCounters* counters, int64_t samples, int64_t S, int64_t rows,
                        int64_t B, int64_t K, int64_t pos0) {
  copy_launch<false>(stream, local_TK, table, counters, samples, S, rows, B, K, pos0,
                     "routing_table_load");
}

}  // namespace moecore::ops::cuda
