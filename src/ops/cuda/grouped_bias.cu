// The grouped (per expert) bias on the GPU, the group sizes read from device memory (no host
// sync). The grid's y index is the group: each thread finds its group's first row by summing
// m_G before it. Forward: a grid-stride loop over the group's elements. Backward: db by
// reduce_cols.cuh's block tiles (a block per (group, 32 x 16 bytes of columns), its 8 warps over
// the group's rows, then the warps in order: one split per group, no second stage), dp a thread
// per row summing its columns in order; one writer and one order per element, no atomics.
#include <algorithm>
#include <string>

#include "ops/bias.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce_cols.cuh"

namespace moecore::ops::cuda {

namespace kernels {

// The first row of group g and its row count (a negative count is treated as 0).
__device__ __forceinline__ void group_rows(const int64_t* m_G, int64_t g, int64_t* row0,
                                           int64_t* rows) {
  int64_t r = 0;
  for (int64_t h = 0; h < g; ++h) r += m_G[h] > 0 ? m_G[h] : 0;
  *row0 = r;
  *rows = m_G[g] > 0 ? m_G[g] : 0;
}

template <typename T>
__global__ void grouped_bias_forward(T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G,
                                     int64_t C) {
  const int64_t g = blockIdx.y;
  int64_t row0 = 0, rows = 0;
  group_rows(m_G, g, &row0, &rows);
  const T* b = b_GC + g * C;
  const int64_t n_el = rows * C, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_el; i += stride) {
    const int64_t n = row0 + i / C, c = i % C;
    if (p_N == nullptr)
      y_NC[n * C + c] += b[c];
    else
      y_NC[n * C + c] += p_N[n] * b[c];
  }
}

// db's terms for reduce_cols.cuh, group blockIdx.z: dy (times p when given) of row m, column c.
// The group's rows from m_G on the device (int: a step's routed rows stay below 2^31).
template <typename T>
struct GroupedBiasDbTerm {
  static constexpr int kOut = 1;
  const T* dy_NC;
  const T* p_N;  // null: no scaling
  const int64_t* m_G;
  __device__ __forceinline__ RowRange rows(int g) const {
    int64_t r0 = 0, n = 0;
    group_rows(m_G, g, &r0, &n);
    return {int(r0), int(n)};
  }
  template <int kLanes>
  __device__ __forceinline__ void add(T (&acc)[1][kLanes], size_t i, int m) const {
    T dy[kLanes];
    load_lanes<kLanes>(dy_NC + i, dy);
    if (p_N == nullptr) {
      for (int l = 0; l < kLanes; ++l) acc[0][l] += dy[l];
    } else {
      const T p = p_N[m];
      for (int l = 0; l < kLanes; ++l) acc[0][l] += p * dy[l];
    }
  }
};

template <typename T>
__global__ void grouped_bias_dp(T* dp_N, const T* dy_NC, const T* b_GC, const int64_t* m_G,
                                int64_t C) {
  const int64_t g = blockIdx.y;
  int64_t row0 = 0, rows = 0;
  group_rows(m_G, g, &row0, &rows);
  const T* b = b_GC + g * C;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < rows; n += stride) {
    const T* dy = dy_NC + (row0 + n) * C;
    T acc = 0;
    for (int64_t c = 0; c < C; ++c) acc += dy[c] * b[c];
    dp_N[row0 + n] += acc;
  }
}

}  // namespace kernels

namespace {
constexpr int64_t kBlock = 128;
// Blocks per group of the grid-stride kernels: the row counts live in device memory, so the grid
// cannot follow them; a group's elements beyond this many blocks loop.
constexpr int64_t kBlocksPerGroup = 32;
constexpr int64_t kMaxGroups = 65535;  // grid.y

void check_args(const char* who, const int64_t* m_G, int64_t G, int64_t C) {
  MOE_KERNEL_CHECK(G >= 0 && G <= kMaxGroups && C >= 0 && C <= int64_t(0x7fffffff) * kBlock &&
                       (G == 0 || m_G != nullptr),
                   std::string("[") + who + "] G=" + std::to_string(G) +
                       " groups, C=" + std::to_string(C) + " columns, m_G " +
                       (m_G ? "set" : "null") + ": 0 <= G <= " + std::to_string(kMaxGroups) +
                       " (the grid's y dimension), C >= 0, m_G set when G > 0");
}
}  // namespace

template <typename T>
void grouped_bias_forward(void* stream, T* y_NC, const T* b_GC, const T* p_N, const int64_t* m_G,
                          int64_t G, int64_t C) {
  check_args("grouped_bias_forward", m_G, G, C);
  if (G == 0 || C == 0) return;
  launch("grouped_bias_forward", kernels::grouped_bias_forward<T>,
         dim3(unsigned(kBlocksPerGroup), unsigned(G)), dim3(unsigned(kBlock)), 0, stream, y_NC,
         b_GC, p_N, m_G, C);
}

template <typename T>
void grouped_bias_backward(void* stream, T* db_GC, T* dp_N, const T* dy_NC, const T* b_GC,
                           const T* p_N, const int64_t* m_G, int64_t G, int64_t C) {
  check_args("grouped_bias_backward", m_G, G, C);
  if (G == 0 || C == 0) return;  // db has no elements; dp gains sums of no columns
  MOE_KERNEL_CHECK(C <= 0x7fffffff, "[grouped_bias_backward] C=" + std::to_string(C) +
                                        " columns: at most 2^31-1 (32-bit index math)");
  // db: reduce_cols.cuh's stage 1 with one split per group (the row counts live on the device,
  // so the grid cannot split them; the groups x column tiles fill it), straight into db.
  ColReducePlan plan;
  plan.M = 1;  // not empty: the groups' rows are on the device
  plan.N = int(C);
  plan.splits = 1;
  plan.rows_per_split = 0x7ffffff8;
  const kernels::GroupedBiasDbTerm<T> term{dy_NC, p_N, m_G};
  T* const out[1] = {db_GC};
  reduce_cols(stream, plan, term, out, int(G), C % kColVecLanes<T> == 0 && all_16_aligned(dy_NC),
              "grouped_bias_db", "grouped_bias_db");
  if (p_N != nullptr && dp_N != nullptr) {
    launch("grouped_bias_dp", kernels::grouped_bias_dp<T>,
           dim3(unsigned(kBlocksPerGroup), unsigned(G)), dim3(unsigned(kBlock)), 0, stream, dp_N,
           dy_NC, b_GC, m_G, C);
  }
}

#define MOECORE_INSTANTIATE_GROUPED_BIAS(T)                                                     \
  template void grouped_bias_forward<T>(void*, T*, const T*, const T*, const int64_t*, int64_t, \
                                        int64_t);                                               \
  template void grouped_bias_backward<T>(void*, T*, T*, const T*, const T*, const T*,           \
                                         const int64_t*, int64_t, int64_t);
MOECORE_INSTANTIATE_GROUPED_BIAS(float)
MOECORE_INSTANTIATE_GROUPED_BIAS(double)
#undef MOECORE_INSTANTIATE_GROUPED_BIAS

}  // namespace moecore::ops::cuda
