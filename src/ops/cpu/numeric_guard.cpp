// The numeric guard's ops on the CPU. The non-finite scan reads every gradient once per step, so
// it is vectorised and threaded; its result is a yes / no, the same for any thread count.
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "ops/numeric_guard.h"

namespace moecore::ops::cpu {

namespace {
constexpr int64_t kMinBlock = int64_t{1} << 15;
constexpr int64_t kMaxBlocks = 256;

// x - x is 0 for a finite x and NaN for NaN and +-Inf: one subtraction per element and an OR of
// the comparisons, which vectorises where std::isfinite's branches would not.
template <typename T>
bool block_has_nonfinite(const T* x, int64_t n) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= !(x[i] - x[i] == T(0));
  return bad != 0;
}
}  // namespace

template <typename T>
void flag_nonfinite(int32_t* flag, const T* x, int64_t n) {
  MOE_CHECK(n >= 0, "[flag_nonfinite] n={} < 0", n);
  if (n == 0) return;
  const int64_t block = std::max(kMinBlock, (n + kMaxBlocks - 1) / kMaxBlocks);
  const int64_t n_blocks = (n + block - 1) / block;
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (n_blocks > 1)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t b0 = b * block;
    bad |= block_has_nonfinite(x + b0, std::min(block, n - b0)) ? 1 : 0;
  }
  if (bad) *flag = 1;
}

void flag_at_least(int32_t* flag, const double* value, const double* threshold) {
  const double v = std::fabs(*value);
  if (std::isfinite(v) && v >= *threshold) *flag = 1;
}

void skip_if_flagged(AdamWStep* step, const int32_t* flags, int64_t n) {
  MOE_CHECK(n >= 0, "[skip_if_flagged] n={} < 0", n);
  for (int64_t i = 0; i < n; ++i) {
    if (flags[i] != 0) {
      step->skip = 1;
      return;
    }
  }
}

template void flag_nonfinite<float>(int32_t*, const float*, int64_t);
template void flag_nonfinite<double>(int32_t*, const double*, int64_t);

}  // namespace moecore::ops::cpu
