// Rotary position embedding as multi-latent attention applies it (Megatron's
// _apply_rotary_pos_emb_bshd with multi_latent_attention): on a D-wide slice of each row (MLA's
// qk_pos_emb_head_dim part of a head, or the shared key part of the KV down projection), with
// any pair frequencies (plain or YaRN, ops/rope_yarn.h) and cos / sin multiplied by YaRN's
// attention factor. Pairing:
// - Interleaved (MLA's; HF's rope_interleave): pairs (x[2i], x[2i+1]) are read, and the result
//   is written de-interleaved, [x_even c - x_odd s | x_odd c + x_even s], as Megatron and HF
//   do (cat(t[0::2], t[1::2]) then rotate_half). q and k both come out in that order, so q.k is
//   the interleaved rotation's.
// - HalfSplit: pairs (x[i], x[i + D/2]), written in place (ops/rope.h's convention).
// Pair i at position p turns by p * inv_freq[i]; y = factor * R(angle) x.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/rope.h"
#include "ops/rope_yarn.h"

namespace moecore::ops {

enum class RopePairing : uint8_t { HalfSplit, Interleaved };

// What the tables are built from: the rotary width D, the base, the pairing and the scaling.
struct RopeMlaSpec {
  int64_t D = 0;
  double base = 10000.0;
  RopePairing pairing = RopePairing::Interleaved;
  RopeScaling scaling;
};

// factor * cos and factor * sin of every (position, pair) [max_pos, D/2], f64, in the backend's
// memory; a view: it owns nothing.
struct RopeMlaCache {
  int64_t max_pos = 0, D = 0;
  RopePairing pairing = RopePairing::Interleaved;
  DevPtr<const double> cos_PD = nullptr, sin_PD = nullptr;
};
// Elements of each table (max_pos * D / 2); checks the arguments.
int64_t rope_mla_table_elems(int64_t max_pos, const RopeMlaSpec& spec);
// Fills the tables (rope_mla_table_elems each, memory of ex) before step 0; waits for the copies.
RopeMlaCache make_rope_mla_cache(const Exec& ex, DevPtr<double> cos_PD, DevPtr<double> sin_PD,
                                 int64_t max_pos, const RopeMlaSpec& spec);
// The tables in an allocation of their own (tests, benchmarks). Setup, not an op.
class RopeMlaTables : RopeTableBlock {
 public:
  RopeMlaTables(int64_t max_pos, const RopeMlaSpec& spec, const Exec& ex = cpu_exec());
  const RopeMlaCache& cache() const { return cache_; }
  operator const RopeMlaCache&() const { return cache_; }  // NOLINT: a view of the tables

 private:
  RopeMlaCache cache_;
};

namespace cpu {
template <typename T>
void rope_mla_forward(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                      int64_t ldy, int64_t ldx, const RopeMlaCache& cache);
template <typename T>
void rope_mla_backward(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                       int64_t ldx, int64_t ldy, const RopeMlaCache& cache);
}  // namespace cpu
// The CUDA kernels (ops/cuda/rope_mla.cu): bitwise the CPU path; a position outside the cache
// gives NaN there (the CPU path throws).
namespace cuda {
template <typename T>
void rope_mla_forward(void* stream, T* y, const T* x, const int32_t* pos_T, int64_t n_tok,
                      int64_t n_heads, int64_t ldy, int64_t ldx, const RopeMlaCache& cache);
template <typename T>
void rope_mla_backward(void* stream, T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok,
                       int64_t n_heads, int64_t ldx, int64_t ldy, const RopeMlaCache& cache);
}  // namespace cuda

// Row r = t * n_heads + h of x starts at x + r * ldx, of y at y + r * ldy (ld >= D); the first D
// elements of each row are rotated, the rest of y is left as it was. Token t is at position
// pos_T[t]. y must not overlap x (the interleaved read order differs from the write order).
template <typename T>
void rope_mla_forward(const Exec& ex, DevPtr<T> y, DevPtr<const T> x, DevPtr<const int32_t> pos_T,
                      int64_t n_tok, int64_t n_heads, int64_t ldy, int64_t ldx,
                      const RopeMlaCache& cache) {
  if (ex.on_cpu())
    return cpu::rope_mla_forward(raw_ptr(y), raw_ptr(x), raw_ptr(pos_T), n_tok, n_heads, ldy, ldx,
                                 cache);
  return cuda::rope_mla_forward(ex.stream, raw_ptr(y), raw_ptr(x), raw_ptr(pos_T), n_tok, n_heads,
                                ldy, ldx, cache);
}
template <typename T>
void rope_mla_forward_ref(T* y, const T* x, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                          int64_t ldy, int64_t ldx, const RopeMlaSpec& spec);
// The transpose: dx (first D of each row, assigned) from dy, rows laid out as in the forward.
template <typename T>
void rope_mla_backward(const Exec& ex, DevPtr<T> dx, DevPtr<const T> dy,
                       DevPtr<const int32_t> pos_T, int64_t n_tok, int64_t n_heads, int64_t ldx,
                       int64_t ldy, const RopeMlaCache& cache) {
  if (ex.on_cpu())
    return cpu::rope_mla_backward(raw_ptr(dx), raw_ptr(dy), raw_ptr(pos_T), n_tok, n_heads, ldx,
                                  ldy, cache);
  return cuda::rope_mla_backward(ex.stream, raw_ptr(dx), raw_ptr(dy), raw_ptr(pos_T), n_tok,
                                 n_heads, ldx, ldy, cache);
}
template <typename T>
void rope_mla_backward_ref(T* dx, const T* dy, const int32_t* pos_T, int64_t n_tok, int64_t n_heads,
                           int64_t ldx, int64_t ldy, const RopeMlaSpec& spec);

}  // namespace moecore::ops
