// Column reductions (out[o][n] += sum over rows m of term_o(m, n)) in two stages with fixed trees,
// the weight-gradient and bias reductions' building block (rmsnorm dw, also the q/k norms';
// LayerNorm dw and db; bias db; the grouped bias's db).
//   Stage 1: a grid of col_tiles x splits blocks of 32 x 8 threads. A block owns a tile of
//   32 x lanes columns (lanes = 16 bytes of T when every operand is 16-byte aligned and the row
//   length a multiple of it: one vector load per operand and row; else 1, scalar loads) and a
//   split of rows_per_split rows: warp w adds rows w, w + 8, ... of its split in order (each
//   lane its columns; the warp's loads are 32 x 16 contiguous bytes), then the 8 warps' sums are
//   added in warp order through shared memory and written to the split's partial row (or, with
//   one split, added into out).
//   Stage 2: the same kernel over the partials [outputs][splits][N] with one split: warp w adds
//   splits w, w + 8, ..., then the warps in order, into out.
// The split count follows from (rows, columns, dtype, outputs) alone (plan_col_reduce), and the
// association of every column's sum from the split count and the 8 warps, never from the
// alignment (the vector and scalar forms add the same terms in the same order) or from timing:
// the bits are the same run to run, and no float atomics are used. Index math is 32-bit: rows
// and columns < 2^31, a row's elements are reached by a pointer step of 8 rows (a 64-bit add).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/reduce_workspace.h"

namespace moecore::ops::cuda {

// 32 lanes along the columns, 8 warps along the rows.
inline constexpr int kColWarps = 8;
inline constexpr int kColBlock = 32 * kColWarps;
// The columns of one thread in the vector form: 16 bytes (float4, double2).
template <typename T>
inline constexpr int kColVecLanes = int(16 / sizeof(T));
// Stage 1's target: one full wave of an H100 SXM (132 SMs x 8 blocks of 256 threads), so that
// every SM streams; the splits stop there (more only adds partials).
inline constexpr int64_t kColTargetBlocks = 132 * 8;
// A split has at least this many rows (8 per warp): fewer would make stage 2 as long as stage 1.
inline constexpr int64_t kColMinRowsPerSplit = 64;

struct ColReducePlan {
  int M = 0, N = 0;        // rows and columns of the terms
  int splits = 1;          // stage 1's blocks along the rows (1: no stage 2)
  int rows_per_split = 0;  // a multiple of 8
};

// The splits of an M x N reduction with n_out outputs of T: enough blocks for a wave (counting
// the column tiles of the vector form, whatever the alignment), splits of at least
// kColMinRowsPerSplit rows, and partials that fit the workspace. Pure: the shapes decide it.
template <typename T>
ColReducePlan plan_col_reduce(int64_t M, int64_t N, int n_out, const char* op) {
  MOE_KERNEL_CHECK(M >= 0 && M <= 0x7fffffff && N >= 0 && N <= 0x7fffffff,
                   std::string("[") + op + "] rows=" + std::to_string(M) +
                       " columns=" + std::to_string(N) + ": both 0 to 2^31-1 (32-bit index math)");
  ColReducePlan p;
  p.M = int(M);
  p.N = int(N);
  if (M == 0 || N == 0) return p;
  const int64_t tile = 32 * kColVecLanes<T>;
  const int64_t col_tiles = (N + tile - 1) / tile;
  int64_t splits = (kColTargetBlocks + col_tiles - 1) / col_tiles;
  splits = std::min(splits, (M + kColMinRowsPerSplit - 1) / kColMinRowsPerSplit);
  splits = std::min<int64_t>(
      splits, int64_t(kReduceWorkspaceBytes / (size_t(n_out) * size_t(N) * sizeof(T))));
  splits = std::max<int64_t>(splits, 1);
  int64_t rows = (M + splits - 1) / splits;
  rows = (rows + kColWarps - 1) / kColWarps * kColWarps;
  p.rows_per_split = int(std::min<int64_t>(rows, 0x7ffffff8));
  p.splits = int((M + p.rows_per_split - 1) / p.rows_per_split);
  return p;
}

// Whether every pointer is 16-byte aligned (null pointers count as aligned).
template <typename... P>
bool all_16_aligned(const P*... p) {
  return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

namespace kernels {

// A group's rows: [row0, row0 + rows) of the operands.
struct RowRange {
  int row0 = 0, rows = 0;
};

// The kLanes values of T at p: one 16-byte load when kLanes is the vector width (p aligned),
// else kLanes scalar loads.
template <int kLanes, typename T>
__device__ __forceinline__ void load_lanes(const T* p, T (&v)[kLanes]) {
  if constexpr (kLanes == kColVecLanes<T> && kLanes > 1) {
    if constexpr (std::is_same_v<T, float>) {
      const float4 q = *reinterpret_cast<const float4*>(p);
      v[0] = q.x;
      v[1] = q.y;
      v[2] = q.z;
      v[3] = q.w;
    } else {
      const double2 q = *reinterpret_cast<const double2*>(p);
      v[0] = q.x;
      v[1] = q.y;
    }
  } else {
    for (int l = 0; l < kLanes; ++l) v[l] = p[l];
  }
}

// The outputs of a column reduction: out[o] + group * N (added into), or the partials.
template <typename T, int kOut>
struct ColOut {
  T* out[kOut];
  T* partials;  // [kOut][splits][N] (stage 1 with splits > 1), else null
  int splits;
};

// One stage (see the file's comment). Term: kOut (outputs), rows(group) (the group's RowRange;
// group = blockIdx.z) and add<kLanes>(acc, i, m): acc[o][l] += term_o(m, column of i + l),
// i the element index of row m's first column of the thread. Dynamic shared memory:
// kColWarps x kOut x 32 x kLanes values of T.
template <typename T, int kLanes, typename Term>
__global__ void __launch_bounds__(kColBlock)
    reduce_cols(Term term, ColOut<T, Term::kOut> out, int N, int rows_per_split) {
  constexpr int kOut = Term::kOut, kTile = 32 * kLanes;
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int group = int(blockIdx.z), split = int(blockIdx.y);
  const int tile0 = int(blockIdx.x) * kTile, c = tile0 + lane * kLanes;
  const RowRange range = term.rows(group);
  const int row0 = range.row0, rows = range.rows;
  T acc[kOut][kLanes];
  for (int o = 0; o < kOut; ++o)
    for (int l = 0; l < kLanes; ++l) acc[o][l] = T(0);
  // The split's rows [r0, r1) of the group; an empty split (a short group) adds nothing.
  const int r0 = int(std::min<int64_t>(int64_t(split) * rows_per_split, rows));
  const int r1 = int(std::min<int64_t>(int64_t(r0) + rows_per_split, rows));
  if (c < N) {  // kLanes > 1 only when N is a multiple of kLanes: the thread's columns all exist
    const size_t step = size_t(kColWarps) * unsigned(N);
    size_t i = size_t(unsigned(row0 + r0 + warp)) * unsigned(N) + unsigned(c);
    for (int m = r0 + warp; m < r1; m += kColWarps, i += step) {
      term.template add<kLanes>(acc, i, row0 + m);
    }
  }
  T* shared = dynamic_shared<T>();  // [warp][o][kTile]
  for (int o = 0; o < kOut; ++o)
    for (int l = 0; l < kLanes; ++l)
      shared[(warp * kOut + o) * kTile + lane * kLanes + l] = acc[o][l];
  __syncthreads();
  // o stays a compile-time constant (a loop of kOut trips, which nvcc unrolls): indexing out.out
  // with a run-time value would copy the parameter array to local memory.
  for (int o = 0; o < kOut; ++o) {
    for (int k = int(threadIdx.x); k < kTile; k += kColBlock) {
      const int col = tile0 + k;
      T s = shared[o * kTile + k];
      for (int w = 1; w < kColWarps; ++w) s += shared[(w * kOut + o) * kTile + k];
      if (col >= N) continue;
      if (out.partials != nullptr) {
        out.partials[(size_t(o) * unsigned(out.splits) + unsigned(split)) * unsigned(N) +
                     unsigned(col)] = s;
      } else {
        out.out[o][size_t(unsigned(group)) * unsigned(N) + unsigned(col)] += s;
      }
    }
  }
}

// Stage 2's terms: the partials [kOut][splits][N], the splits as rows.
template <typename T, int kOut_>
struct PartialsTerm {
  static constexpr int kOut = kOut_;
  const T* partials;
  int splits, N;
  __device__ __forceinline__ RowRange rows(int) const { return {0, splits}; }
  template <int kLanes>
  __device__ __forceinline__ void add(T (&acc)[kOut][kLanes], size_t i, int) const {
    for (int o = 0; o < kOut; ++o) {
      T v[kLanes];
      load_lanes<kLanes>(partials + size_t(o) * unsigned(splits) * unsigned(N) + i, v);
      for (int l = 0; l < kLanes; ++l) acc[o][l] += v[l];
    }
  }
};

}  // namespace kernels

// out[o][g * N + n] += sum_m term_o(m, n) for every group g < groups (each of term.rows(g) rows;
// groups > 1 only with p.splits == 1), in the two stages above. `vec`: every operand term reads
// is 16-byte aligned and N a multiple of kColVecLanes<T> (the caller's check: it knows the
// operands). Names: stage 1's kernel and stage 2's, for errors.
template <typename T, typename Term>
void reduce_cols(void* stream, const ColReducePlan& p, const Term& term,
                 T* const (&out)[Term::kOut], int groups, bool vec, const char* stage1,
                 const char* stage2) {
  constexpr int kOut = Term::kOut;
  if (p.M == 0 || p.N == 0 || groups == 0) return;
  MOE_KERNEL_CHECK(groups == 1 || p.splits == 1,
                   std::string("[") + stage1 + "] " + std::to_string(groups) + " groups with " +
                       std::to_string(p.splits) + " splits: one of them is 1");
  const int lanes = vec ? kColVecLanes<T> : 1;
  const unsigned col_tiles = unsigned((int64_t(p.N) + 32 * lanes - 1) / (32 * lanes));
  const size_t smem = size_t(kColWarps) * kOut * 32 * size_t(lanes) * sizeof(T);
  kernels::ColOut<T, kOut> o{};
  for (int i = 0; i < kOut; ++i) o.out[i] = out[i];
  o.splits = p.splits;
  if (p.splits > 1) {
    o.partials = static_cast<T*>(
        reduce_workspace(stream, size_t(kOut) * size_t(p.splits) * size_t(p.N) * sizeof(T)));
  }
  const dim3 grid1(col_tiles, unsigned(p.splits), unsigned(groups));
  if (vec) {
    launch(stage1, kernels::reduce_cols<T, kColVecLanes<T>, Term>, grid1, dim3(kColBlock), smem,
           stream, term, o, p.N, p.rows_per_split);
  } else {
    launch(stage1, kernels::reduce_cols<T, 1, Term>, grid1, dim3(kColBlock), smem, stream, term, o,
           p.N, p.rows_per_split);
  }
  if (p.splits == 1) return;
  // The partials are 16-byte aligned (the workspace is): vector loads when N allows them.
  const kernels::PartialsTerm<T, kOut> partials{o.partials, p.splits, p.N};
  kernels::ColOut<T, kOut> o2{};
  for (int i = 0; i < kOut; ++i) o2.out[i] = out[i];
  o2.splits = 1;
  const bool vec2 = p.N % kColVecLanes<T> == 0;
  const int lanes2 = vec2 ? kColVecLanes<T> : 1;
  const unsigned tiles2 = unsigned((int64_t(p.N) + 32 * lanes2 - 1) / (32 * lanes2));
  const size_t smem2 = size_t(kColWarps) * kOut * 32 * size_t(lanes2) * sizeof(T);
  // One split over all partial rows: rows_per_split >= splits.
  const int rows2 = (p.splits + kColWarps - 1) / kColWarps * kColWarps;
  if (vec2) {
    launch(stage2, kernels::reduce_cols<T, kColVecLanes<T>, kernels::PartialsTerm<T, kOut>>,
           dim3(tiles2), dim3(kColBlock), smem2, stream, partials, o2, p.N, rows2);
  } else {
    launch(stage2, kernels::reduce_cols<T, 1, kernels::PartialsTerm<T, kOut>>, dim3(tiles2),
           dim3(kColBlock), smem2, stream, partials, o2, p.N, rows2);
  }
}

}  // namespace moecore::ops::cuda
