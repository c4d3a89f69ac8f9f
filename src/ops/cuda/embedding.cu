// Token embedding on the GPU, of the whole table or of a TP rank's slice of its rows [v0, v0 +
// rows) (the _shard ops). The lookups: grid-stride loops over the output's elements. The backward
// without atomics, bitwise the CPU's: a thread owns one column h of one range of the table's rows
// (grid.x the column blocks, grid.y the row ranges) and walks the tokens in order, adding dy[t][h]
// into dw[ids[t] - v0][h] when ids[t] - v0 falls in its range, so every dw element has one writer
// and receives its tokens in token order, as on the CPU.
//
// Out-of-range ids: the CPU throws; a kernel cannot without a host sync (none inside a step). The
// data pipeline checks every token against the vocabulary on the host when it loads a batch, so
// a bad id reaching the device is a bug upstream: the kernels never read or write outside the
// table, the forward fills that token's row with NaN (the step's non-finite guard reports it)
// and the backward skips the token. The slice's lookup gives zeros for the ids of [0, V) outside
// the slice (another rank's rows), NaN for ids outside [0, V).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "ops/cast.h"
#include "ops/cuda/launch.cuh"
#include "ops/embedding.h"

namespace moecore::ops::cuda {

namespace kernels {
__device__ __forceinline__ int64_t thread_index() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() {
  return int64_t(gridDim.x) * blockDim.x;
}

template <typename T>
__device__ __forceinline__ T widen(T v) {
  return v;
}
__device__ __forceinline__ float widen(uint16_t bits) {
  return bf16_bits_to_f32(bits);
}

// y[t][h] = widen(w[ids[t]][h]); NaN for an id outside [0, V).
template <typename Y, typename W>
__global__ void embedding_forward(Y* y_TH, const int32_t* ids_T, const W* w_VH, int64_t n_tok,
                                  int64_t H, int64_t V) {
  for (int64_t i = thread_index(); i < n_tok * H; i += thread_count()) {
    const int64_t t = i / H, h = i % H;
    const int64_t id = ids_T[t];
    y_TH[i] = id >= 0 && id < V ? Y(widen(w_VH[id * H + h])) : std::numeric_limits<Y>::quiet_NaN();
  }
}

// The slice's lookup: y[t][h] = w[ids[t] - v0][h] for the ids in [v0, v0 + rows), 0 for the
// other ids of [0, V), NaN outside [0, V).
template <typename T>
__global__ void embedding_forward_shard(T* y_TH, const int32_t* ids_T, const T* w_RH, int64_t n_tok,
                                        int64_t H, int64_t v0, int64_t rows, int64_t V) {
  for (int64_t i = thread_index(); i < n_tok * H; i += thread_count()) {
    const int64_t t = i / H, h = i % H;
    const int64_t id = ids_T[t], r = id - v0;
    y_TH[i] = r >= 0 && r < rows  ? w_RH[r * H + h]
              : id >= 0 && id < V ? T(0)
                                  : std::numeric_limits<T>::quiet_NaN();
  }
}

// dw_RH holds the table's rows [v0, v0 + n_rows); blockIdx.y: its rows [r0, r0 + rows) (the last
// range cut at n_rows). Ids outside [v0, v0 + n_rows) belong to no range.
template <typename T>
__global__ void embedding_backward(T* dw_RH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                                   int64_t H, int64_t v0, int64_t n_rows, int64_t rows) {
  const int64_t h = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= H) return;
  const int64_t r0 = int64_t(blockIdx.y) * rows, r1 = r0 + rows < n_rows ? r0 + rows : n_rows;
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t r = int64_t(ids_T[t]) - v0;
    if (r >= r0 && r < r1) dw_RH[r * H + h] += dy_TH[t * H + h];
  }
}
}  // namespace kernels

namespace {
constexpr int64_t kBlock = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill a GPU
// The backward: columns per block, and about how many blocks to spread over the row ranges (each
// range rescans the ids: more ranges, more parallel work, more id reads).
constexpr int64_t kBackwardBlock = 128;
constexpr int64_t kBackwardBlocks = 1024;

void check_shape(int64_t n_tok, int64_t H, int64_t V, const char* op) {
  MOE_KERNEL_CHECK(n_tok >= 0 && H > 0 && V > 0 && V <= int64_t(1) << 31,
                   std::string("[") + op + "] tokens=" + std::to_string(n_tok) +
                       " (>= 0), hidden=" + std::to_string(H) +
                       " (> 0), vocabulary=" + std::to_string(V) + " (1 to 2^31, int32 ids)");
}

void check_slice(int64_t v0, int64_t rows, int64_t V, const char* op) {
  MOE_KERNEL_CHECK(v0 >= 0 && rows >= 0 && (rows == 0 || v0 + rows <= V),
                   std::string("[") + op + "] bad vocabulary slice: rows [" + std::to_string(v0) +
                       ", " + std::to_string(v0 + rows) + ") of V=" + std::to_string(V) +
                       " (needs 0 <= v0, 0 <= rows, v0 + rows <= V unless the slice is empty: "
                       "a TP rank of padding only)");
}

template <typename Y, typename W>
void forward_launch(void* stream, Y* y_TH, const int32_t* ids_T, const W* w_VH, int64_t n_tok,
                    int64_t H, int64_t V, const char* op) {
  check_shape(n_tok, H, V, op);
  if (n_tok == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = std::min(kMaxBlocks, (n_tok * H + kBlock - 1) / kBlock);
  launch(op, kernels::embedding_forward<Y, W>, dim3(unsigned(blocks)), dim3(unsigned(kBlock)), 0,
         stream, y_TH, ids_T, w_VH, n_tok, H, V);
}

// dw_RH (the table's rows [v0, v0 + n_rows)) += the tokens' rows of dy, in token order.
template <typename T>
void backward_launch(void* stream, T* dw_RH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                     int64_t H, int64_t v0, int64_t n_rows, const char* op) {
  if (n_tok == 0 || n_rows == 0) return;  // dw gains nothing (an empty slice has no rows)
  const int64_t col_blocks = (H + kBackwardBlock - 1) / kBackwardBlock;
  const int64_t ranges =
      std::clamp<int64_t>(kBackwardBlocks / col_blocks, 1, std::min<int64_t>(n_rows, 65535));
  const int64_t rows = (n_rows + ranges - 1) / ranges;
  MOE_KERNEL_CHECK(col_blocks <= 0x7fffffff,
                   std::string("[") + op + "] hidden=" + std::to_string(H) + " needs " +
                       std::to_string(col_blocks) + " column blocks (at most 2^31-1)");
  launch(op, kernels::embedding_backward<T>,
         dim3(unsigned(col_blocks), unsigned((n_rows + rows - 1) / rows)),
         dim3(unsigned(kBackwardBlock)), 0, stream, dw_RH, dy_TH, ids_T, n_tok, H, v0, n_rows,
         rows);
}
}  // namespace

template <typename T>
void embedding_forward(void* stream, T* y_TH, const int32_t* ids_T, const T* w_VH, int64_t n_tok,
                       int64_t H, int64_t V) {
  forward_launch(stream, y_TH, ids_T, w_VH, n_tok, H, V, "embedding_forward");
}

void embedding_forward_bf16(void* stream, float* y_TH, const int32_t* ids_T, const bf16* w_VH,
                            int64_t n_tok, int64_t H, int64_t V) {
  static_assert(sizeof(bf16) == sizeof(uint16_t));
  forward_launch(stream, y_TH, ids_T, reinterpret_cast<const uint16_t*>(w_VH), n_tok, H, V,
                 "embedding_forward_bf16");
}

template <typename T>
void embedding_backward(void* stream, T* dw_VH, const T* dy_TH, const int32_t* ids_T, int64_t n_tok,
                        int64_t H, int64_t V) {
  check_shape(n_tok, H, V, "embedding_backward");
  backward_launch(stream, dw_VH, dy_TH, ids_T, n_tok, H, 0, V, "embedding_backward");
}

template <typename T>
void embedding_forward_shard(void* stream, T* y_TH, const int32_t* ids_T, const T* w_RH,
                             int64_t n_tok, int64_t H, int64_t v0, int64_t rows, int64_t V) {
  check_shape(n_tok, H, V, "embedding_forward_shard");
  check_slice(v0, rows, V, "embedding_forward_shard");
  if (n_tok == 0) return;  // a grid of no blocks is a launch error
  const int64_t blocks = std::min(kMaxBlocks, (n_tok * H + kBlock - 1) / kBlock);
  launch("embedding_forward_shard", kernels::embedding_forward_shard<T>, dim3(unsigned(blocks)),
         dim3(unsigned(kBlock)), 0, stream, y_TH, ids_T, w_RH, n_tok, H, v0, rows, V);
}

template <typename T>
void embedding_backward_shard(void* stream, T* dw_RH, const T* dy_TH, const int32_t* ids_T,
                              int64_t n_tok, int64_t H, int64_t v0, int64_t rows, int64_t V) {
  check_shape(n_tok, H, V, "embedding_backward_shard");
  check_slice(v0, rows, V, "embedding_backward_shard");
  backward_launch(stream, dw_RH, dy_TH, ids_T, n_tok, H, v0, rows, "embedding_backward_shard");
}

template void embedding_forward<float>(void*, float*, const int32_t*, const float*, int64_t,
                                       int64_t, int64_t);
template void embedding_forward<double>(void*, double*, const int32_t*, const double*, int64_t,
                                        int64_t, int64_t);
template void embedding_backward<float>(void*, float*, const float*, const int32_t*, int64_t,
                                        int64_t, int64_t);
template void embedding_backward<double>(void*, double*, const double*, const int32_t*, int64_t,
                                         int64_t, int64_t);
template void embedding_forward_shard<float>(void*, float*, const int32_t*, const float*, int64_t,
                                             int64_t, int64_t, int64_t, int64_t);
template void embedding_forward_shard<double>(void*, double*, const int32_t*, const double*,
                                              int64_t, int64_t, int64_t, int64_t, int64_t);
template void embedding_backward_shard<float>(void*, float*, const float*, const int32_t*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t);
template void embedding_backward_shard<double>(void*, double*, const double*, const int32_t*,
                                               int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace moecore::ops::cuda
