// The log-sum-exp merge on the CPU: the weights of a row once (attention_merge_weights, in
// double), then its D values; OpenMP over the (row, b, head) rows of large tensors.
#include "core/check.h"
#include "ops/attention_merge.h"

namespace moecore::ops::cpu {
namespace {
constexpr int64_t kParallelMin = int64_t{1} << 16;  // elements
}  // namespace

template <typename T>
void attention_merge(T* out, T* lse, const T* out_i, const T* lse_i, const AttentionShape& s) {
  check_attention_merge_shape(s, "attention_merge");
  const int64_t rows = s.S * s.B * s.Hq;
#pragma omp parallel for schedule(static) if (rows * s.D >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {  // r = (i * B + b) * Hq + h: the layout of out
    const int64_t h = r % s.Hq, b = (r / s.Hq) % s.B, i = r / (s.Hq * s.B);
    const int64_t at = (b * s.Hq + h) * s.lse_ld() + i;
    double merged, w, w_i;
    attention_merge_weights(static_cast<double>(lse[at]), static_cast<double>(lse_i[at]), merged,
                            w, w_i);
    T* o = out + r * s.D;
    const T* o2 = out_i + r * s.D;
    for (int64_t d = 0; d < s.D; ++d) {
      o[d] = static_cast<T>(w * static_cast<double>(o[d]) + w_i * static_cast<double>(o2[d]));
    }
    lse[at] = static_cast<T>(merged);
  }
}

template void attention_merge<float>(float*, float*, const float*, const float*,
                                     const AttentionShape&);
template void attention_merge<double>(double*, double*, const double*, const double*,
                                      const AttentionShape&);

}  // namespace moecore::ops::cpu
