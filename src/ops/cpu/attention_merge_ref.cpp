// Plain-loop log-sum-exp merge of two partial attentions: the oracle of the CPU path and the
// CUDA kernel, written from the formula (log-sum-exp with the max taken out), not from the
// shared weights body.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "ops/attention_merge.h"

namespace moecore::ops {

void check_attention_merge_shape(const AttentionShape& s, const char* op) {
  MOE_CHECK(s.S >= 0 && s.B >= 0 && s.Hq > 0 && s.D > 0,
            "[{}] bad shape S={} B={} Hq={} D={}: sizes must be >= 0 and Hq, D > 0", op, s.S, s.B,
            s.Hq, s.D);
  MOE_CHECK(s.lse_stride == 0 || s.lse_stride >= s.S,
            "[{}] lse_stride={} < S={}: pass 0 (= S) or the length of the layer's lse rows", op,
            s.lse_stride, s.S);
}

template <typename T>
void attention_merge_ref(T* out, T* lse, const T* out_i, const T* lse_i, const AttentionShape& s) {
  check_attention_merge_shape(s, "attention_merge_ref");
  const double kNegInf = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.Hq; ++h) {
      for (int64_t i = 0; i < s.S; ++i) {
        const int64_t at = (b * s.Hq + h) * s.lse_ld() + i;
        const double l1 = static_cast<double>(lse[at]), l2 = static_cast<double>(lse_i[at]);
        const double m = std::max(l1, l2);
        double lse_new = m, w1 = 0.0, w2 = 0.0;
        if (m != kNegInf) {
          lse_new = m + std::log(std::exp(l1 - m) + std::exp(l2 - m));
          w1 = std::exp(l1 - lse_new);
          w2 = std::exp(l2 - lse_new);
        }
        T* o = out + ((i * s.B + b) * s.Hq + h) * s.D;
        const T* o2 = out_i + ((i * s.B + b) * s.Hq + h) * s.D;
        for (int64_t d = 0; d < s.D; ++d) {
          o[d] = static_cast<T>(w1 * static_cast<double>(o[d]) + w2 * static_cast<double>(o2[d]));
        }
        lse[at] = static_cast<T>(lse_new);
      }
    }
  }
}

template void attention_merge_ref<float>(float*, float*, const float*, const float*,
                                         const AttentionShape&);
template void attention_merge_ref<double>(double*, double*, const double*, const double*,
                                          const AttentionShape&);

}  // namespace moecore::ops
