// The maximum of a row of logits for the softmax-like CPU paths (the fused head's cross entropy,
// the vocab-parallel cross entropy's row pieces): kLanes running maxima (a vector register or
// two) and one final pass over them. `omp simd reduction(max)` over std::max stays scalar with
// GCC 12 (a vmaxss chain that cost 60% of the forward's softmax). The maximum is exact, so the
// order does not matter; every lane starts from z[0], so a NaN there propagates as the reference's
// sequential scan gives it.
#pragma once

#include <cstdint>

namespace moecore::ops {

// max of z[0, V), V >= 1.
template <typename T>
T row_max(const T* z, int64_t V) {
  constexpr int64_t kLanes = 32;
  T lane[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) lane[j] = z[0];
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) lane[j] = z[v + j] > lane[j] ? z[v + j] : lane[j];
  }
  T mx = z[0];
  for (; v < V; ++v) mx = z[v] > mx ? z[v] : mx;
  for (int64_t j = 0; j < kLanes; ++j) mx = lane[j] > mx ? lane[j] : mx;
  return mx;
}

}  // namespace moecore::ops
