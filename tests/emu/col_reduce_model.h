// The association of src/ops/cuda/reduce_cols.cuh's column sums as plain loops, for the grid
// emulator's tests to require the kernels' bits exactly (the emulator computes the host's
// roundings and nothing contracts): per split, 8 warps each adding rows w, w + 8, ... from 0 in
// order, the warps added in order; with more than one split, the splits' partials added the same
// way (warp w: splits w, w + 8, ...), then the warps in order. Written from the kernel's comment,
// not from its code.
#pragma once

#include <cstdint>
#include <vector>

#include "emu/cuda_emu.h"  // before the kernel header: the emulator's CUDA keywords
#include "ops/cuda/reduce_cols.cuh"

namespace moecore::emu_test {

// The sum over rows [0, rows) of column n, as reduce_cols associates it: term(acc, m) adds row
// m's term to acc (the kernel's own expression for it).
template <typename T, typename Term>
T col_tree_sum(const ops::cuda::ColReducePlan& p, int64_t rows, Term term) {
  constexpr int kWarps = ops::cuda::kColWarps;
  const auto warps_then_sum = [](const std::vector<T>& warp) {
    T s = warp[0];
    for (int w = 1; w < kWarps; ++w) s += warp[size_t(w)];
    return s;
  };
  std::vector<T> partial;
  for (int64_t s = 0; s * p.rows_per_split < rows || (s == 0 && rows == 0); ++s) {
    const int64_t r0 = s * p.rows_per_split;
    const int64_t r1 = std::min<int64_t>(r0 + p.rows_per_split, rows);
    std::vector<T> warp(kWarps, T(0));
    for (int w = 0; w < kWarps; ++w) {
      for (int64_t m = r0 + w; m < r1; m += kWarps) term(warp[size_t(w)], m);
    }
    partial.push_back(warps_then_sum(warp));
  }
  if (partial.size() == 1) return partial[0];
  std::vector<T> warp(kWarps, T(0));
  for (int w = 0; w < kWarps; ++w) {
    for (size_t s = size_t(w); s < partial.size(); s += kWarps) warp[size_t(w)] += partial[s];
  }
  return warps_then_sum(warp);
}

}  // namespace moecore::emu_test
