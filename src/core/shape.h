// The number of elements of a tensor of a given shape: one definition for the parameter
// registry, the checkpoint and the converter.
#pragma once

#include <cstdint>
#include <functional>
#include <numeric>
#include <span>

namespace moecore {

// The product of the dimensions (1 for the empty shape of a scalar).
inline int64_t shape_numel(std::span<const int64_t> shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

}  // namespace moecore
