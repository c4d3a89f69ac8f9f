// Fast MLA RoPE: factor * cos / sin from tables built once before step 0 (make_rope_mla_cache),
// rows split across OpenMP threads; each element's operations are fixed, so any thread count
// gives the same bits. Pair layout and conventions: ops/rope_mla.h.
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "ops/memory.h"
#include "ops/rope_mla.h"

namespace moecore::ops {

int64_t rope_mla_table_elems(int64_t max_pos, const RopeMlaSpec& spec) {
  MOE_CHECK(max_pos > 0, "[rope_mla] max_pos={} must be > 0: pass the longest sequence length",
            max_pos);
  MOE_CHECK(spec.D > 0 && spec.D % 2 == 0,
            "[rope_mla] rotary dim D={} must be even and > 0: check --qk-pos-emb-head-dim", spec.D);
  return max_pos * (spec.D / 2);
}

RopeMlaCache make_rope_mla_cache(const Exec& ex, DevPtr<double> cos_PD, DevPtr<double> sin_PD,
                                 int64_t max_pos, const RopeMlaSpec& spec) {
  const int64_t n = rope_mla_table_elems(max_pos, spec), half = spec.D / 2;
  MOE_CHECK(cos_PD != nullptr && sin_PD != nullptr,
            "[rope_mla] no memory for the tables ({} elements each): allocate them first", n);
  const std::vector<double> inv_freq = rope_inv_freq(spec.D, spec.base, spec.scaling);
  const double factor = rope_attention_factor(spec.scaling);
  std::vector<double> cos_h(static_cast<size_t>(n)), sin_h(static_cast<size_t>(n));
  for (int64_t p = 0; p < max_pos; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      // The reference's expressions, so f64 fast and reference agree to the last bit.
      const double angle = static_cast<double>(p) * inv_freq[size_t(i)];
      cos_h[size_t(p * half + i)] = std::cos(angle) * factor;
      sin_h[size_t(p * half + i)] = std::sin(angle) * factor;
    }
  }
  copy<double>(ex, cos_PD, cos_h.data(), n);
  copy<double>(ex, sin_PD, sin_h.data(), n);
  exec_synchronize(ex);  // the host vectors go out of scope
  return RopeMlaCache{max_pos, spec.D, spec.pairing, cos_PD, sin_PD};
}

RopeMlaTables::RopeMlaTables(int64_t max_pos, const RopeMlaSpec& spec, const Exec& ex)
    : RopeTableBlock(rope_mla_table_elems(max_pos, spec), ex),
      cache_(make_rope_mla_cache(ex, cos_table(), sin_table(), max_pos, spec)) {}

namespace {

template <typename T>
void check_args(const char* op, const T* out, int64_t ld_out, const T* in, int64_t ld_in,
                const int32_t* pos_T, int64_t n_tok, int64_t n_heads, const RopeMlaCache& cache) {
  const int64_t D = cache.D;
  MOE_CHECK(D > 0 && D % 2 == 0 && cache.max_pos > 0 && cache.cos_PD != nullptr &&
                cache.sin_PD != nullptr,
            "[{}] cache not built (D={}, max_pos={}): use make_rope_mla_cache or RopeMlaTables", op,
            D, cache.max_pos);
  MOE_CHECK(n_tok >= 0 && n_heads >= 0, "[{}] negative size n_tok={} n_heads={}", op, n_tok,
            n_heads);
  MOE_CHECK(ld_out >= D && ld_in >= D,
            "[{}] row strides {} (out) and {} (in) must be >= the rotary dim D={}", op, ld_out,
            ld_in, D);
  const int64_t rows = n_tok * n_heads;
  if (rows == 0) return;
  // The interleaved read order differs from the write order: no overlap at all.
  const T* out_end = out + (rows - 1) * ld_out + D;
  const T* in_end = in + (rows - 1) * ld_in + D;
  MOE_CHECK(out_end <= in || in_end <= out,
            "[{}] output overlaps the input ({} rows): write to a separate buffer", op, rows);
  // Positions checked up front: a throw inside the OpenMP region would terminate instead.
  for (int64_t t = 0; t < n_tok; ++t) {
    MOE_CHECK(pos_T[t] >= 0 && pos_T[t] < cache.max_pos,
              "[{}] token {} at position {} outside the cache [0, {}): build the cache with "
              "max_pos >= the longest sequence",
              op, t, pos_T[t], cache.max_pos);
  }
}

// The forward and its transpose are one rotation: the forward reads each pair in the cache's
// pairing, writes it half-split and turns by +angle; the backward reads half-split, writes the
// pairing and turns by -angle (the transpose of factor * R(angle) is factor * R(-angle)).
template <typename T>
void rope_mla_rotate(T* out, const T* in, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                     int64_t ld_out, int64_t ld_in, const RopeMlaCache& cache, bool backward) {
  const int64_t D = cache.D, half = D / 2;
  const bool inter = cache.pairing == RopePairing::Interleaved;
  const bool read_pairs = inter && !backward, write_pairs = inter && backward;
  const double* cos_PD = raw_ptr(cache.cos_PD);
  const double* sin_PD = raw_ptr(cache.sin_PD);
#pragma omp parallel for schedule(static) if (n_tok * n_heads * D >= (int64_t{1} << 15))
  for (int64_t t = 0; t < n_tok; ++t) {
    const double* cos_D = cos_PD + static_cast<int64_t>(pos_T[t]) * half;
    const double* sin_D = sin_PD + static_cast<int64_t>(pos_T[t]) * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      const T* ir = in + (t * n_heads + h) * ld_in;
      T* orow = out + (t * n_heads + h) * ld_out;
      for (int64_t i = 0; i < half; ++i) {
        const T c = static_cast<T>(cos_D[i]);
        const T s = backward ? -static_cast<T>(sin_D[i]) : static_cast<T>(sin_D[i]);
        const T a = read_pairs ? ir[2 * i] : ir[i], b = read_pairs ? ir[2 * i + 1] : ir[i + half];
        // A rounded product, then one fused multiply-add, written out so no compiler contracts
        // its own way; the CUDA kernel does the same operations.
        const T first = std::fma(a, c, -(b * s)), second = std::fma(b, c, a * s);
        orow[write_pairs ? 2 * i : i] = first;
        orow[write_pairs ? 2 * i + 1 : i + half] = second;
      }
    }
  }
}

}  // namespace

namespace cpu {

template <typename T>
void rope_mla_forward(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                      int64_t ldy, int64_t ldx, const RopeMlaCache& cache) {
  check_args("rope_mla_forward", y, ldy, x, ldx, pos_T, n_tok, n_heads, cache);
  rope_mla_rotate(y, x, pos_T, n_tok, n_heads, ldy, ldx, cache, /*backward=*/false);
}

template <typename T>
void rope_mla_backward(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                       int64_t ldx, int64_t ldy, const RopeMlaCache& cache) {
  check_args("rope_mla_backward", dx, ldx, dy, ldy, pos_T, n_tok, n_heads, cache);
  rope_mla_rotate(dx, dy, pos_T, n_tok, n_heads, ldx, ldy, cache, /*backward=*/true);
}

#define MOECORE_INSTANTIATE_ROPE_MLA(T)                                                       \
  template void rope_mla_forward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t,  \
                                    int64_t, const RopeMlaCache&);                            \
  template void rope_mla_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                     int64_t, const RopeMlaCache&);
MOECORE_INSTANTIATE_ROPE_MLA(float)
MOECORE_INSTANTIATE_ROPE_MLA(double)
#undef MOECORE_INSTANTIATE_ROPE_MLA

}  // namespace cpu
}  // namespace moecore::ops
