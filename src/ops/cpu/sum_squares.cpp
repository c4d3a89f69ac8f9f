// Sum of squares, fixed-order blocked reduction (ops/sum_squares.h).
#include <algorithm>

#include "core/check.h"
#include "ops/sum_squares.h"

namespace moecore::ops::cpu {

namespace {
// Sum of squares in f64, bitwise the same for any thread count: at most kMaxBlocks fixed blocks
// (their bounds depend on n only), each summed over kLanes independent lanes (vectorised; the
// lanes hide the add latency) that are added in lane order, then the block sums in block order.
// The earlier `omp parallel for reduction(+)` was a scalar chain of dependent f64 adds (about
// half the optimizer's time) whose association depended on the thread count.
constexpr int64_t kMaxBlocks = 256;
constexpr int64_t kLanes = 32;
constexpr int64_t kMinBlock = int64_t{1} << 14;

template <typename T>
double block_sum_squares(const T* g, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      const double x = static_cast<double>(g[i + j]);
      acc[j] += x * x;
    }
  }
  for (int64_t j = 0; i + j < n; ++j) {
    const double x = static_cast<double>(g[i + j]);
    acc[j] += x * x;
  }
  double s = 0;
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

template <typename T>
double blocked_sum_squares(const T* g, int64_t n) {
  // Blocks a multiple of kLanes long: every block starts 128-byte aligned (f32) when g does.
  int64_t block = std::max(kMinBlock, (n + kMaxBlocks - 1) / kMaxBlocks);
  block = (block + kLanes - 1) / kLanes * kLanes;
  const int64_t n_blocks = (n + block - 1) / block;
  double part[kMaxBlocks];
#pragma omp parallel for schedule(static) if (n_blocks > 1)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t b0 = b * block;
    part[b] = block_sum_squares(g + b0, std::min(block, n - b0));
  }
  double s = 0;
  for (int64_t b = 0; b < n_blocks; ++b) s += part[b];
  return s;
}
}  // namespace

template <typename T>
void sum_squares(double* out, const T* x, int64_t n) {
  MOE_CHECK(n >= 0, "[sum_squares] n={} < 0", n);
  *out = n == 0 ? 0.0 : blocked_sum_squares(x, n);
}

template <typename T>
void sum_squares_ranges(double* out, const T* x, const ElemRange* ranges, int64_t n_ranges) {
  MOE_CHECK(n_ranges >= 0, "[sum_squares] {} ranges < 0", n_ranges);
  double s = 0;
  for (int64_t r = 0; r < n_ranges; ++r) {
    MOE_CHECK(ranges[r].begin >= 0 && ranges[r].count >= 0,
              "[sum_squares] range {}: begin {} count {}", r, ranges[r].begin, ranges[r].count);
    if (ranges[r].count > 0) s += blocked_sum_squares(x + ranges[r].begin, ranges[r].count);
  }
  *out = s;
}

template void sum_squares<float>(double*, const float*, int64_t);
template void sum_squares<double>(double*, const double*, int64_t);
template void sum_squares_ranges<float>(double*, const float*, const ElemRange*, int64_t);
template void sum_squares_ranges<double>(double*, const double*, const ElemRange*, int64_t);

}  // namespace moecore::ops::cpu
