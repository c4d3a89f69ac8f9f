// Plain-loop MLA RoPE: the oracle for the fast path and the kernel. Each element's angle and
// factor are computed in double here (the frequencies from rope_inv_freq, tested against
// Megatron's formulas on their own), the rotation in double, rounded once to T.
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "ops/rope_mla.h"

namespace moecore::ops {

namespace {

// Position of pair i's two elements in the input row of the forward (the pairing's), and in its
// output row (always [first of each pair | second of each pair]).
void pair_index(RopePairing pairing, int64_t i, int64_t half, int64_t& a, int64_t& b) {
  if (pairing == RopePairing::Interleaved) {
    a = 2 * i, b = 2 * i + 1;
  } else {
    a = i, b = i + half;
  }
}

template <typename T>
void rope_mla_ref(T* out, const T* in, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                  int64_t ld_out, int64_t ld_in, const RopeMlaSpec& spec, bool backward) {
  const int64_t D = spec.D;
  MOE_CHECK(D > 0 && D % 2 == 0, "[rope_mla_ref] rotary dim D={} must be even and > 0", D);
  MOE_CHECK(n_tok >= 0 && n_heads >= 0 && ld_out >= D && ld_in >= D,
            "[rope_mla_ref] bad sizes n_tok={} n_heads={} strides {} {} for D={}", n_tok, n_heads,
            ld_out, ld_in, D);
  const std::vector<double> inv_freq = rope_inv_freq(D, spec.base, spec.scaling);
  const double factor = rope_attention_factor(spec.scaling);
  const int64_t half = D / 2;
  for (int64_t t = 0; t < n_tok; ++t) {
    MOE_CHECK(pos_T[t] >= 0, "[rope_mla_ref] token {} has negative position {}", t, pos_T[t]);
    for (int64_t h = 0; h < n_heads; ++h) {
      const T* ir = in + (t * n_heads + h) * ld_in;
      T* orow = out + (t * n_heads + h) * ld_out;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos_T[t]) * inv_freq[size_t(i)];
        const double c = std::cos(angle) * factor, s = std::sin(angle) * factor;
        int64_t a = 0, b = 0;
        pair_index(spec.pairing, i, half, a, b);
        if (!backward) {
          const double xa = static_cast<double>(ir[a]), xb = static_cast<double>(ir[b]);
          orow[i] = static_cast<T>(xa * c - xb * s);
          orow[i + half] = static_cast<T>(xb * c + xa * s);
        } else {
          // dL/dx_a = c g1 + s g2, dL/dx_b = -s g1 + c g2 (the forward's matrix transposed).
          const double g1 = static_cast<double>(ir[i]), g2 = static_cast<double>(ir[i + half]);
          orow[a] = static_cast<T>(g1 * c + g2 * s);
          orow[b] = static_cast<T>(g2 * c - g1 * s);
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_mla_forward_ref(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                          int64_t ldy, int64_t ldx, const RopeMlaSpec& spec) {
  rope_mla_ref(y, x, pos_T, n_tok, n_heads, ldy, ldx, spec, false);
}

template <typename T>
void rope_mla_backward_ref(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                           int64_t ldx, int64_t ldy, const RopeMlaSpec& spec) {
  rope_mla_ref(dx, dy, pos_T, n_tok, n_heads, ldx, ldy, spec, true);
}

#define MOECORE_INSTANTIATE_ROPE_MLA_REF(T)                                                       \
  template void rope_mla_forward_ref<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t,  \
                                        int64_t, const RopeMlaSpec&);                             \
  template void rope_mla_backward_ref<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                         int64_t, const RopeMlaSpec&);
MOECORE_INSTANTIATE_ROPE_MLA_REF(float)
MOECORE_INSTANTIATE_ROPE_MLA_REF(double)
#undef MOECORE_INSTANTIATE_ROPE_MLA_REF

}  // namespace moecore::ops
