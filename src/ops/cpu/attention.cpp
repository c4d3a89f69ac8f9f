// Fast CPU causal GQA attention: flash-style (the forward saves only out and lse; the backward
// recomputes P from lse) with hand-written AVX-512 register tiles for f32. K and V of each
// (b, kv head) are packed once per call into the layouts the tiles stream; the backward owns one
// (b, kv head) per task, so dK/dV need no atomics and are bitwise reproducible for any thread
// count. f64 (gradient checks) and builds without AVX-512 run the same blocking on ops::gemm.
//
// Why not ops::gemm: at S = 256, D = 64 the products are 64 x (<= 256) x 64; dnnl_sgemm's
// per-call overhead and its strided reads of [S, B, heads, D] (rows 4-16 KiB apart, so every
// row of a block falls in the same L1 sets) held the op at 30-45 GFLOP/s per core, and the
// softmax loops around it were scalar. Here each product is a loop of register tiles over packed,
// contiguous operands, causality is applied per tile (a tile computes only the keys its last
// row may see, not the whole 64-row block's), and exp runs 16 lanes at a time.
//
// Blocking: a unit of work is a block of 64 query rows of a run of up to 4 query heads (one
// (b, kv head) for the backward). Its Q (and dO) rows are packed [head][64, D] (16 KiB per head
// at D = 64, L1/L2 resident), the scores of one head [64, S] live in the thread's slab, and the
// K/V operands are the (b, kv head)'s packs (64 KiB each at S = 256, L2 resident), reused by all
// the heads of the group and all row blocks.
//
// Dropout of the probabilities is one more pass over a head's block of P (and, in the backward,
// of dP) between the products, drawing the keep bits of 64 keys at a time (dropout_mask.h); the
// block is all that is ever masked. Without dropout the pass is skipped per head, outside every
// loop over elements.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
// GCC 12.2 warns "'__Y' may be used uninitialized" inside the unmasked AVX-512 intrinsics (their
// _mm512_undefined_ps() pass-through, GCC bug 105593, fixed in 12.3): silence it for the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "core/check.h"
#include "core/profiler.h"
#include "ops/attention.h"
#include "ops/cpu/dropout_mask.h"
#include "ops/cpu/fast_exp.h"
#include "ops/gemm.h"

namespace moecore::ops {

namespace {

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

// Query rows per block: a thread holds P and dS of one block, [kRowBlock, S] each. Causality is
// applied per register tile, so the block size costs no wasted FLOPs; 64 rows amortise the
// load/store of the dK/dV tiles in the backward (once per block) over 64 rank-1 updates.
constexpr int64_t kRowBlock = 64;
constexpr int64_t kLanes = 16;  // f32 per zmm register: the unit every packed dim is padded to
constexpr int64_t kPanel = 64;  // keys per K^T panel (the widest scores tile)
// Query heads whose rows are packed together: the heads of a position are adjacent in memory,
// so their rows come in one contiguous read (each position is on its own page once B * Hq * D
// is large: one visit per position instead of one per head).
constexpr int64_t kHeadsPerTask = 4;

constexpr int64_t round_up(int64_t x, int64_t a) {
  return (x + a - 1) / a * a;
}

// Sizes of the packed operands and per-thread buffers; all multiples of 16 elements, so every
// buffer starts 64-byte aligned once the workspace base is.
// The block form (AttentionShape::is_block): N keys, key j visible to query row i iff
// j <= i + shift (shift = q_offset - k_offset >= 0); the whole sequence is N = S, shift = 0.
struct Blocking {
  int64_t S, B, Hq, Hkv, D, group;
  int64_t N;         // keys
  int64_t shift;     // q_offset - k_offset: row i sees keys j <= i + shift (and j < N)
  int64_t ldq, ldk;  // row strides of q/out and k/v along S
  int64_t Dp;        // D padded to 16: row stride of packed rows [*, Dp] (pad columns are 0)
  int64_t Sp;        // N padded to 16: row stride of P and dS
  int64_t Sk;        // N padded to kPanel: keys in K^T / V^T panels
  int64_t bk, n_blocks;

  explicit Blocking(const AttentionShape& s)
      : S(s.S),
        B(s.B),
        Hq(s.Hq),
        Hkv(s.Hkv),
        D(s.D),
        group(s.Hq / s.Hkv),
        N(s.keys()),
        shift(s.q_offset - s.k_offset),
        ldq(s.B * s.Hq * s.D),
        ldk(s.B * s.Hkv * s.D),
        Dp(round_up(s.D, kLanes)),
        Sp(round_up(s.keys(), kLanes)),
        Sk(round_up(s.keys(), kPanel)),
        bk(std::min(s.S, kRowBlock)),
        n_blocks(bk > 0 ? (s.S + bk - 1) / bk : 0) {}

  // The last key row i sees, and the keys rows before `end` see: [0, key_end(end)).
  int64_t last_key(int64_t i) const { return std::min(i + shift, N - 1); }
  int64_t key_end(int64_t end) const { return std::min(end + shift, N); }

  // K/V operands of one (b, kv head): K^T (and V^T) in panels [Sk / 64][D][64] (the scores
  // tiles read 64 consecutive keys of one d), V (or K) as rows [S, Dp] (the P V and dS K tiles
  // read whole rows). The forward packs K^T + V rows of every (b, kv head) once, for all threads
  // to share; a backward task packs K^T + V^T + K rows of its own (b, kv head) into its thread's
  // slab (hot in L2 from one task to the next, no barrier).
  int64_t panel_elems() const { return Sk * D; }
  int64_t fwd_pack_elems() const { return panel_elems() + N * Dp; }
  int64_t bwd_pack_elems() const { return 2 * panel_elems() + N * Dp; }
  // Per thread: Q, dO and O (or dQ) rows of one block for up to kHeadsPerTask heads
  // [kHeadsPerTask][bk, Dp] each, P and dS [bk, Sp], one value per row and head, the
  // backward's dK and dV accumulators [Sp, Dp] each and its K/V pack.
  int64_t head_stride() const { return bk * Dp; }
  int64_t slab_elems() const {
    return 3 * kHeadsPerTask * head_stride() + 2 * bk * Sp + kHeadsPerTask * round_up(bk, kLanes) +
           2 * Sp * Dp + bwd_pack_elems();
  }
  int64_t workspace_elems(int n_threads) const {
    return kLanes + B * Hkv * fwd_pack_elems() + n_threads * slab_elems();  // + alignment slack
  }
};

// Lanes 0..last (clamped to 0..15) set; none when last < 0.
inline uint16_t lanes_upto(int64_t last) {
  return last >= 15 ? uint16_t(0xFFFF) : last < 0 ? uint16_t(0) : uint16_t((2u << last) - 1u);
}

#if defined(__AVX512F__)
// x[0 .. min(16, n)) with zeros after; a plain load when all 16 lanes are real.
inline __m512 load_upto(const float* x, int64_t n) {
  return n >= 16 ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(lanes_upto(n - 1), x);
}

// Lanes 8..15 of x as a 256-bit vector (a shuffle: extractf32x8 trips GCC 12's warning above).
inline __m256 high_half(__m512 x) {
  return _mm512_castps512_ps256(_mm512_shuffle_f32x4(x, x, 0xEE));
}
#endif

template <typename T>
T* align64(T* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T*>((a + 63) & ~uintptr_t{63});
}

template <typename T>
constexpr bool use_avx512() {
  return kAvx512 && std::is_same_v<T, float>;
}

// Asks for bytes [x, x + n) to be brought into cache ahead of use.
inline void prefetch_span(const void* x, int64_t n, bool for_write = false) {
  const char* p = static_cast<const char*>(x);
  for (int64_t byte = 0; byte < n; byte += 64) {
    if (for_write)
      __builtin_prefetch(p + byte, 1, 2);
    else
      __builtin_prefetch(p + byte, 0, 2);
  }
}

// Prefetches the strided rows the next unit of work will read (or write) a few cache lines at a
// time, between register tiles of the current unit. Rows of [S, B, heads, D] are 2-16 KiB apart,
// each on its own page, where the hardware prefetchers do not follow; read on demand, packing
// the q/dO/O rows and writing dq cost ~15% of the backward at the benchmark shape. Prefetches
// issued in bursts (a block's rows at once, or a row per softmax row) did not measurably help;
// trickled between tiles they roughly halved those stalls.
class Prefetcher {
 public:
  // n rows of `bytes` bytes at base + j * ld_bytes.
  void add(const void* base, int64_t ld_bytes, int64_t n, int64_t bytes, bool for_write = false) {
    if (n_spans_ < kMaxSpans && n > 0) {
      spans_[n_spans_++] = Span{static_cast<const char*>(base), ld_bytes, n, bytes, for_write};
    }
  }
  // Issues the next few lines (called once per register tile).
  void step() {
    for (int i = 0; i < kLinesPerStep && span_ < n_spans_; ++i) {
      const Span& s = spans_[span_];
      const char* p = s.base + row_ * s.ld + byte_;
      if (s.write)
        __builtin_prefetch(p, 1, 2);
      else
        __builtin_prefetch(p, 0, 2);
      if ((byte_ += 64) >= s.bytes) {
        byte_ = 0;
        if (++row_ == s.n) row_ = 0, ++span_;
      }
    }
  }

 private:
  struct Span {
    const char* base;
    int64_t ld, n, bytes;
    bool write;
  };
  static constexpr int kMaxSpans = 4;
  static constexpr int kLinesPerStep = 16;  // ~1 KiB per tile of ~1,500 FMAs: far below DRAM rate
  Span spans_[kMaxSpans];
  int n_spans_ = 0, span_ = 0;
  int64_t row_ = 0, byte_ = 0;
};

// K^T panels of one (b, kv head) from rows x[j * ld + d]; keys N..Sp-1 are zero, keys past Sp
// (the rest of the last panel) are never read.
template <typename T>
void pack_panels(T* dst, const T* x, int64_t ld, const Blocking& L) {
#if defined(__AVX512F__)
  // Gathers of 16 keys per d: reads stay within 16 rows that L1 holds across the d loop, writes
  // are whole vectors. (The scalar loop below compiles to scatters, ~4 cycles per element.)
  if constexpr (use_avx512<T>()) {
    if (15 * ld < (int64_t{1} << 31)) {
      const __m512i idx = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(static_cast<int32_t>(ld)));
      for (int64_t j = 0; j < L.Sp; j += kLanes) {
        for (int64_t jn = j + 2 * kLanes; jn < std::min(L.N, j + 3 * kLanes); ++jn) {
          prefetch_span(x + jn * ld, L.D * int64_t{sizeof(T)});
        }
        T* col = dst + (j / kPanel) * kPanel * L.D + j % kPanel;
        const __mmask16 k = lanes_upto(L.N - 1 - j);
        const T* src = x + std::min(j, L.N - 1) * ld;  // any valid row when k == 0
        for (int64_t d = 0; d < L.D; ++d) {
          _mm512_store_ps(col + d * kPanel,
                          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, idx, src + d, 4));
        }
      }
      return;
    }
  }
#endif
  for (int64_t j0 = 0; j0 < L.Sp; j0 += kPanel) {
    T* panel = dst + j0 * L.D;
    for (int64_t jj = 0; jj < std::min(kPanel, L.Sp - j0); ++jj) {
      const int64_t j = j0 + jj;
      for (int64_t d = 0; d < L.D; ++d) panel[d * kPanel + jj] = j < L.N ? x[j * ld + d] : T(0);
    }
  }
}

// The D values of row j, head hh: x[j * ld + hh * D + (0..D)] to dst[hh * hs + j * Dp + (0..Dp)],
// for j < n, hh < hc, pad columns zero. With hc > 1 the heads of a position are adjacent in x,
// so each position is one contiguous read (the point of packing heads together: one page visit
// per position instead of one per head).
template <typename T>
void pack_rows(T* dst, const T* x, int64_t ld, int64_t n, const Blocking& L, int64_t hc = 1,
               int64_t hs = 0) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + 8 < n) prefetch_span(x + (j + 8) * ld, hc * L.D * int64_t{sizeof(T)});
    for (int64_t hh = 0; hh < hc; ++hh) {
      const T* src = x + j * ld + hh * L.D;
      T* out = dst + hh * hs + j * L.Dp;
#if defined(__AVX512F__)
      if constexpr (use_avx512<T>()) {
        for (int64_t c = 0; c < L.Dp; c += kLanes) {
          _mm512_store_ps(out + c, load_upto(src + c, L.D - c));
        }
        continue;
      }
#endif
      std::memcpy(out, src, L.D * sizeof(T));
      std::fill(out + L.D, out + L.Dp, T(0));
    }
  }
}

// The inverse of pack_rows for n positions of hc heads: src[hh * hs + j * Dp + (0..D)] to
// x[j * ld + hh * D + (0..D)].
template <typename T>
void unpack_rows(T* x, const T* src, int64_t ld, int64_t n, const Blocking& L, int64_t hc,
                 int64_t hs) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t hh = 0; hh < hc; ++hh) {
      std::memcpy(x + j * ld + hh * L.D, src + hh * hs + j * L.Dp, L.D * sizeof(T));
    }
  }
}

// ---- The three products of a row block (rows i0 .. i0+m-1 of one query head) ----
// scores:     C[r, j]  = alpha * sum_d A[r, d] Kt[d, j]      for j <= i0 + r (at least)
// rows_times: C[r, :]  = rowscale[r] * sum_{j <= i0+r} P[r, j] X[j, :]      (assigned)
// cols_times: C[j, :] += sum_{r : i0+r >= j} P[r, j] Y[r, :]  for j < i0 + m (accumulated)
// P is zero above the diagonal up to column round_up(i0 + m, 16), so a tile may run past a row's
// last key as long as it stays inside that range.

#if defined(__AVX512F__)

// Registers: a tile keeps R x N accumulators (<= 24 of the 32 zmm) plus its N operand vectors.
// Rows beyond `rows` (the block's tail) read row 0 again and are not stored: constant trip
// counts keep the accumulators in registers.

// C[r, 16 nj] = alpha * A[r, :D] . Kt panel[:, 16 nj], R rows x NJ vectors of keys.
template <int R, int NJ>
inline void tile_scores(const float* A, int64_t lda, const float* Kt, int64_t D, float alpha,
                        float* C, int64_t ldc, int rows) {
  __m512 acc[R][NJ];
  const float* a[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    a[r] = A + (r < rows ? r : 0) * lda;
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) kv[j] = _mm512_load_ps(Kt + d * kPanel + 16 * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r][d]);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_fmadd_ps(av, kv[j], acc[r][j]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) {
      _mm512_store_ps(C + r * ldc + 16 * j, _mm512_mul_ps(al, acc[r][j]));
    }
  }
}

// C[r, 16 NV] = s_r * sum_{j < n} P[r, j] X[j, 16 NV]; the last vector stored under `tail`.
template <int R, int NV>
inline void tile_rows(const float* P, int64_t ldp, const float* X, int64_t ldx, int64_t n,
                      const float* rowscale, float* C, int64_t ldc, __mmask16 tail, int rows) {
  __m512 acc[R][NV];
  const float* p[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    p[r] = P + (r < rows ? r : 0) * ldp;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 xv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) xv[v] = _mm512_load_ps(X + j * ldx + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(pv, xv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
    const __m512 s = _mm512_set1_ps(rowscale[r]);
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) {
      _mm512_storeu_ps(C + r * ldc + 16 * v, _mm512_mul_ps(s, acc[r][v]));
    }
    _mm512_mask_storeu_ps(C + r * ldc + 16 * (NV - 1), tail, _mm512_mul_ps(s, acc[r][NV - 1]));
  }
}

// C[j, 16 NV] += sum_{r in [r0, r1)} P[r, j] Y[r, 16 NV] for RJ keys j (`cols` of them real).
template <int RJ, int NV>
inline void tile_cols(const float* P, int64_t ldp, const float* Y, int64_t ldy, int64_t r0,
                      int64_t r1, float* C, int64_t ldc, __mmask16 tail, int cols) {
  __m512 acc[RJ][NV];
  int col[RJ];
#pragma GCC unroll 16
  for (int c = 0; c < RJ; ++c) {
    col[c] = c < cols ? c : 0;
    const float* cr = C + col[c] * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) acc[c][v] = _mm512_loadu_ps(cr + 16 * v);
    acc[c][NV - 1] = _mm512_maskz_loadu_ps(tail, cr + 16 * (NV - 1));
  }
  for (int64_t r = r0; r < r1; ++r) {
    __m512 yv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) yv[v] = _mm512_load_ps(Y + r * ldy + 16 * v);
    const float* pr = P + r * ldp;
#pragma GCC unroll 16
    for (int c = 0; c < RJ; ++c) {
      const __m512 pv = _mm512_set1_ps(pr[col[c]]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_fmadd_ps(pv, yv[v], acc[c][v]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < RJ; ++c) {
    if (c >= cols) break;
    float* cr = C + c * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(cr + 16 * v, acc[c][v]);
    _mm512_mask_storeu_ps(cr + 16 * (NV - 1), tail, acc[c][NV - 1]);
  }
}

// Rows per tile for NV vectors of D: ~24 accumulators, leaving registers for the operands.
template <int NV>
constexpr int kTileRows = NV == 4   ? 6
                          : NV == 3 ? 8
                                    : 12;

// Columns of D are done in chunks of up to 4 vectors (64 floats); the mask covers the real
// columns of a chunk's last vector.
__mmask16 tail_mask(int64_t c0, int nv, int64_t D) {
  const int64_t left = D - (c0 + 16 * (nv - 1));  // real columns in the last vector, 1..16
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
}

void scores(const float* A, const float* Kt, float alpha, float* C, const Blocking& L, int64_t i0,
            int64_t m, Prefetcher& pf) {
  constexpr int R = 6;
  for (int64_t r0 = 0; r0 < m; r0 += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, m - r0));
    // Causal per tile: its last row (position i0 + r0 + rows - 1) sees keys < key_end(that + 1).
    const int64_t n = round_up(L.key_end(i0 + r0 + rows), kLanes);
    for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
      pf.step();
      const float* kt = Kt + j0 * L.D;  // panel j0 / 64
      const float* a = A + r0 * L.Dp;
      float* c = C + r0 * L.Sp + j0;
      switch (std::min<int64_t>(4, (n - j0) / kLanes)) {
        case 4:
          tile_scores<R, 4>(a, L.Dp, kt, L.D, alpha, c, L.Sp, rows);
          break;
        case 3:
          tile_scores<R, 3>(a, L.Dp, kt, L.D, alpha, c, L.Sp, rows);
          break;
        case 2:
          tile_scores<R, 2>(a, L.Dp, kt, L.D, alpha, c, L.Sp, rows);
          break;
        default:
          tile_scores<R, 1>(a, L.Dp, kt, L.D, alpha, c, L.Sp, rows);
          break;
      }
    }
  }
}

template <int NV>
void rows_times_nv(const float* P, const float* X, const float* rowscale, float* C, int64_t ldc,
                   const Blocking& L, int64_t i0, int64_t m, int64_t c0, Prefetcher& pf) {
  constexpr int R = kTileRows<NV>;
  const __mmask16 tail = tail_mask(c0, NV, L.D);
  for (int64_t r0 = 0; r0 < m; r0 += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, m - r0));
    pf.step();
    tile_rows<R, NV>(P + r0 * L.Sp, L.Sp, X + c0, L.Dp, L.key_end(i0 + r0 + rows), rowscale + r0,
                     C + r0 * ldc + c0, ldc, tail, rows);
  }
}

void rows_times(const float* P, const float* X, const float* rowscale, float* C, int64_t ldc,
                const Blocking& L, int64_t i0, int64_t m, Prefetcher& pf) {
  for (int64_t c0 = 0; c0 < L.Dp; c0 += 64) {
    switch (std::min<int64_t>(4, (L.Dp - c0) / kLanes)) {
      case 4:
        rows_times_nv<4>(P, X, rowscale, C, ldc, L, i0, m, c0, pf);
        break;
      case 3:
        rows_times_nv<3>(P, X, rowscale, C, ldc, L, i0, m, c0, pf);
        break;
      case 2:
        rows_times_nv<2>(P, X, rowscale, C, ldc, L, i0, m, c0, pf);
        break;
      default:
        rows_times_nv<1>(P, X, rowscale, C, ldc, L, i0, m, c0, pf);
        break;
    }
  }
}

template <int NV>
void cols_times_nv(const float* P, const float* Y, float* C, int64_t ldc, const Blocking& L,
                   int64_t i0, int64_t m, int64_t c0, Prefetcher& pf) {
  constexpr int RJ = kTileRows<NV>;
  const __mmask16 tail = tail_mask(c0, NV, L.D);
  const int64_t n = L.key_end(i0 + m);
  for (int64_t j0 = 0; j0 < n; j0 += RJ) {
    const int cols = static_cast<int>(std::min<int64_t>(RJ, n - j0));
    // Causal per tile: rows whose last key precedes key j0 have P = 0 on all of its keys.
    const int64_t r0 = std::max<int64_t>(0, j0 - L.shift - i0);
    pf.step();
    tile_cols<RJ, NV>(P + j0, L.Sp, Y + c0, L.Dp, r0, m, C + j0 * ldc + c0, ldc, tail, cols);
  }
}

void cols_times(const float* P, const float* Y, float* C, int64_t ldc, const Blocking& L,
                int64_t i0, int64_t m, Prefetcher& pf) {
  for (int64_t c0 = 0; c0 < L.Dp; c0 += 64) {
    switch (std::min<int64_t>(4, (L.Dp - c0) / kLanes)) {
      case 4:
        cols_times_nv<4>(P, Y, C, ldc, L, i0, m, c0, pf);
        break;
      case 3:
        cols_times_nv<3>(P, Y, C, ldc, L, i0, m, c0, pf);
        break;
      case 2:
        cols_times_nv<2>(P, Y, C, ldc, L, i0, m, c0, pf);
        break;
      default:
        cols_times_nv<1>(P, Y, C, ldc, L, i0, m, c0, pf);
        break;
    }
  }
}

#endif  // __AVX512F__

// The three products on ops::gemm (oneDNN for f32 without AVX-512, loops for f64): same
// contracts, each a few whole-block GEMMs instead of register tiles, so builds for CPUs without
// AVX-512 keep the speed of a BLAS. They run over the block's full key range; the softmax
// passes mask what lies above the diagonal.
template <typename T>
void scores_gemm(const T* A, const T* Kt, T alpha, T* C, const Blocking& L, int64_t i0, int64_t m,
                 Prefetcher& pf) {
  const int64_t n = std::min(L.Sp, round_up(L.key_end(i0 + m), kLanes));
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {  // one GEMM per 64-key panel of K^T
    pf.step();
    cpu::gemm<T>(false, false, m, std::min(kPanel, n - j0), L.D, alpha, A, L.Dp, Kt + j0 * L.D,
                 kPanel, T(0), C + j0, L.Sp);
  }
}

template <typename T>
void rows_times_gemm(const T* P, const T* X, const T* rowscale, T* C, int64_t ldc,
                     const Blocking& L, int64_t i0, int64_t m, Prefetcher& pf) {
  pf.step();
  cpu::gemm<T>(false, false, m, L.D, L.key_end(i0 + m), T(1), P, L.Sp, X, L.Dp, T(0), C, ldc);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t d = 0; d < L.D; ++d) C[r * ldc + d] *= rowscale[r];
  }
}

template <typename T>
void cols_times_gemm(const T* P, const T* Y, T* C, int64_t ldc, const Blocking& L, int64_t i0,
                     int64_t m, Prefetcher& pf) {
  pf.step();
  cpu::gemm<T>(true, false, L.key_end(i0 + m), L.D, m, T(1), P, L.Sp, Y, L.Dp, T(1), C, ldc);
}

template <typename T>
void scores_any(const T* A, const T* Kt, T alpha, T* C, const Blocking& L, int64_t i0, int64_t m,
                Prefetcher& pf) {
#if defined(__AVX512F__)
  if constexpr (use_avx512<T>()) return scores(A, Kt, alpha, C, L, i0, m, pf);
#endif
  scores_gemm(A, Kt, alpha, C, L, i0, m, pf);
}

template <typename T>
void rows_times_any(const T* P, const T* X, const T* rowscale, T* C, int64_t ldc, const Blocking& L,
                    int64_t i0, int64_t m, Prefetcher& pf) {
#if defined(__AVX512F__)
  if constexpr (use_avx512<T>()) return rows_times(P, X, rowscale, C, ldc, L, i0, m, pf);
#endif
  rows_times_gemm(P, X, rowscale, C, ldc, L, i0, m, pf);
}

template <typename T>
void cols_times_any(const T* P, const T* Y, T* C, int64_t ldc, const Blocking& L, int64_t i0,
                    int64_t m, Prefetcher& pf) {
#if defined(__AVX512F__)
  if constexpr (use_avx512<T>()) return cols_times(P, Y, C, ldc, L, i0, m, pf);
#endif
  cols_times_gemm(P, Y, C, ldc, L, i0, m, pf);
}

// Softmax of each row of a block over its keys j <= i, in place on the scaled scores: P holds
// exp(s - max), inv_sum the row's 1/sum (applied to the output row, D values, rather than to P,
// up to S values), lse_h[i] = max + log(sum). Zeros from j = i + 1 up to the next 16 keys past
// the block's last row: the P V tiles read that far.
template <typename T>
void softmax_rows(T* P, T* inv_sum, T* lse_h, const Blocking& L, int64_t i0, int64_t m) {
  const int64_t fill = std::min(L.Sp, round_up(L.key_end(i0 + m), kLanes));
  for (int64_t rr = 0; rr < m; ++rr) {
    const int64_t i = i0 + rr, last = L.last_key(i);
    T* p = P + rr * L.Sp;
    double sum = 0.0;  // up to S terms: accumulate wide, it is nearly free
    T mx = p[0];
#if defined(__AVX512F__)
    if constexpr (use_avx512<T>()) {
      // Lanes past key `last` are masked out of every read, so scores the tiles never wrote (beyond
      // their causal range) are never touched.
      __m512 vmx = _mm512_set1_ps(p[0]);
      for (int64_t j = 0; j <= last; j += 16) {
        const __mmask16 k = lanes_upto(last - j);
        vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_load_ps(k, p + j));
      }
      mx = _mm512_reduce_max_ps(vmx);
      const __m512 vm = _mm512_set1_ps(mx);
      // Sums in f32 lanes: each of the 16 adds at most S / 16 terms in (0, 1], rounding
      // ~1e-7 relative at S = 1024; the lanes are then added in double.
      __m512 vs = _mm512_setzero_ps();
      for (int64_t j = 0; j <= last; j += 16) {
        const __mmask16 k = lanes_upto(last - j);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_load_ps(k, p + j), vm);
        const __m512 e = _mm512_maskz_mov_ps(k, fast_exp16(x));
        _mm512_store_ps(p + j, e);
        vs = _mm512_add_ps(vs, e);
      }
      for (int64_t j = round_up(last + 1, kLanes); j < fill; j += 16) {
        _mm512_store_ps(p + j, _mm512_setzero_ps());
      }
      sum = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(vs)),
                                               _mm512_cvtps_pd(high_half(vs))));
    } else
#endif
    {
      for (int64_t j = 1; j <= last; ++j) mx = std::max(mx, p[j]);
      for (int64_t j = 0; j <= last; ++j) {
        p[j] = fast_exp(p[j] - mx);
        sum += static_cast<double>(p[j]);
      }
      std::fill(p + last + 1, p + fill, T(0));
    }
    inv_sum[rr] = static_cast<T>(1.0 / sum);
    lse_h[i] = static_cast<T>(static_cast<double>(mx) + std::log(sum));
  }
}

// Backward of the softmax for a block: P = exp(scale * q.k - lse) from the scaled scores in P
// (the saved lse replaces the max/sum pass), delta_i = sum_j P_ij dP_ij, and
// dS = scale * P * (dP - delta) in place of dP; the scale of dQ = scale dS K and
// dK = scale dS^T Q is folded in here. Both zero above the diagonal up to the next 16 keys past
// the block (the P^T tiles read that far).
// delta from P and dP (two passes over an L1-resident row, ~i/16 vector FMAs) rather than as
// rowsum(dO * O) (D per row): the same value, but it spares reading O, whose rows were the
// backward's costliest cache misses (4 MiB from DRAM per call at the benchmark shape).
// delta_given (the block form): delta_i of the merged output, rowsum(dO o O), per row of the
// block, used instead of the block's own sum_j P_ij dP_ij (a part of it only).
template <typename T>
void softmax_grad_rows(T* P, T* dS, const T* lse_h, T scale, const Blocking& L, int64_t i0,
                       int64_t m, const double* delta_given) {
  const int64_t fill = std::min(L.Sp, round_up(L.key_end(i0 + m), kLanes));
  for (int64_t rr = 0; rr < m; ++rr) {
    const int64_t i = i0 + rr, last = L.last_key(i);
    T* p = P + rr * L.Sp;
    T* ds = dS + rr * L.Sp;
#if defined(__AVX512F__)
    if constexpr (use_avx512<T>()) {
      const __m512 vl = _mm512_set1_ps(lse_h[i]);
      // delta in f32 lanes (each adds at most S / 16 terms, P_ij <= 1), the lanes in double.
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j <= last; j += 16) {
        const __mmask16 k = lanes_upto(last - j);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_load_ps(k, p + j), vl);
        const __m512 e = _mm512_maskz_mov_ps(k, fast_exp16(x));
        _mm512_store_ps(p + j, e);
        acc = _mm512_fmadd_ps(e, _mm512_maskz_load_ps(k, ds + j), acc);
      }
      const double delta =
          delta_given != nullptr
              ? delta_given[rr]
              : _mm512_reduce_add_pd(_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(acc)),
                                                   _mm512_cvtps_pd(high_half(acc))));
      const __m512 vd = _mm512_set1_ps(static_cast<float>(delta));
      const __m512 vs = _mm512_set1_ps(scale);
      for (int64_t j = 0; j <= last; j += 16) {
        // Lanes past key `last`: P is 0 and dP masked to 0, so dS is 0 (never garbage * 0).
        const __m512 g = _mm512_maskz_load_ps(lanes_upto(last - j), ds + j);
        const __m512 e = _mm512_load_ps(p + j);
        _mm512_store_ps(ds + j, _mm512_mul_ps(_mm512_mul_ps(vs, e), _mm512_sub_ps(g, vd)));
      }
      for (int64_t j = round_up(last + 1, kLanes); j < fill; j += 16) {
        _mm512_store_ps(p + j, _mm512_setzero_ps());
        _mm512_store_ps(ds + j, _mm512_setzero_ps());
      }
      continue;
    }
#endif
    const T lse_i = lse_h[i];
    double delta = 0.0;
    for (int64_t j = 0; j <= last; ++j) {
      p[j] = fast_exp(p[j] - lse_i);
      delta += static_cast<double>(p[j]) * static_cast<double>(ds[j]);
    }
    const T delta_i = static_cast<T>(delta_given != nullptr ? delta_given[rr] : delta);
    for (int64_t j = 0; j <= last; ++j) ds[j] = scale * p[j] * (ds[j] - delta_i);
    std::fill(p + last + 1, p + fill, T(0));
    std::fill(ds + last + 1, ds + fill, T(0));
  }
}

// The dropout of one call: the keep bits of head h of sample b are the stream
// dropout_head_key(key, head0 + h) at (iteration, sample0 + b, query i, key j).
template <typename T>
struct BlockDropout {
  bool on = false;
  uint64_t key = 0;
  int64_t head0 = 0, iteration = 0, sample0 = 0;
  int64_t q_offset = 0, k_offset = 0;  // global positions of query row 0 and key 0
  uint32_t threshold = 0;
  T scale = T(1);

  BlockDropout(const AttentionDropout* drop, const AttentionShape& s)
      : q_offset(s.q_offset), k_offset(s.k_offset) {
    if (drop == nullptr || drop->p == 0.0) return;
    const DropoutCounters* c = raw_ptr(drop->counters);
    on = true;
    key = drop->key;
    head0 = drop->head0;
    iteration = c->iteration;
    sample0 = c->sample0;
    threshold = dropout_threshold(drop->p);
    scale = dropout_scale<T>(drop->p);
  }

  // X[rr, j] *= M[i0 + rr, j] for the visible keys j <= last_key(i0 + rr) of the block's rows
  // (row stride Sp), drawn at the global (q_offset + i, k_offset + j).
  void apply(T* X, const Blocking& L, int64_t b, int64_t h, int64_t i0, int64_t m) const {
    const uint64_t hk = dropout_head_key(key, static_cast<uint64_t>(head0 + h));
    for (int64_t rr = 0; rr < m; ++rr) {
      const int64_t i = i0 + rr;
      const cpu::DropoutRow row(hk, static_cast<uint64_t>(iteration),
                                static_cast<uint64_t>(sample0 + b),
                                static_cast<uint64_t>(q_offset + i), threshold);
      cpu::dropout_row_in_place_at(X + rr * L.Sp, L.last_key(i) + 1, k_offset, row, scale);
    }
  }
};

}  // namespace

int64_t attention_workspace_elems(const AttentionShape& s, int n_threads) {
  check_attention_shape(s, "attention");
  MOE_CHECK(n_threads >= 1,
            "[attention] n_threads={}: pass omp_get_max_threads() of the thread that will call "
            "attention_forward/backward",
            n_threads);
  return Blocking(s).workspace_elems(n_threads);
}

namespace cpu {

// Workspace contract: `workspace` holds attention_workspace_elems(s, omp_get_max_threads())
// elements, omp_get_max_threads() as seen by the calling thread at the time of the call (the
// team below is exactly that size, and thread t uses slab t only). Layout after aligning the
// base to 64 bytes: B * Hkv forward packs (Blocking::fwd_pack_elems), then one slab per thread.
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, const AttentionShape& s,
                       T* workspace, const AttentionDropout* drop) {
  ScopedPhase phase(Phase::Attention);
  check_attention_shape(s, "attention");
  check_attention_dropout(drop, "attention");
  if (s.S == 0 || s.B == 0) return;
  MOE_CHECK(workspace != nullptr,
            "[attention] forward got no workspace: allocate attention_workspace_elems(shape, "
            "omp_get_max_threads()) elements before step 0");
  const Blocking L(s);
  const int64_t S = L.S, B = L.B, Hq = L.Hq, Hkv = L.Hkv, D = L.D, bk = L.bk;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(D)));
  const int n_threads = omp_get_max_threads();
  // Heads per task: up to kHeadsPerTask, fewer when that would leave under 4 tasks per thread.
  const int64_t hs = L.head_stride();
  int64_t hc = kHeadsPerTask;
  while (hc > 1 && L.n_blocks * B * ((Hq + hc - 1) / hc) < 4 * n_threads) hc /= 2;
  const int64_t n_chunks = (Hq + hc - 1) / hc, n_bc = B * n_chunks;
  const int64_t n_tasks = L.n_blocks * n_bc;
  const int64_t per_grab = std::clamp<int64_t>(n_tasks / (8 * n_threads), 1, 4);
  const int64_t n_grabs = (n_tasks + per_grab - 1) / per_grab;
  T* packs = align64(workspace);
  T* slabs = packs + B * Hkv * L.fwd_pack_elems();
  const BlockDropout<T> dropout(drop, s);

#pragma omp parallel num_threads(n_threads)
  {
    T* Qc = slabs + omp_get_thread_num() * L.slab_elems();  // [hc][bk, Dp] queries
    T* Oc = Qc + 2 * kHeadsPerTask * hs;                    // [hc][bk, Dp] outputs
    T* P = Oc + kHeadsPerTask * hs;                         // [bk, Sp] scores, then exp
    T* inv_sum = P + 2 * bk * L.Sp;                         // [bk]

    // Pack K^T panels and V rows of every (b, kv head) once; all its query heads reuse them.
    // (dynamic: a thread the OS preempts does not hold the others at the barrier below.)
#pragma omp for schedule(dynamic, 1)
    for (int64_t bg = 0; bg < B * Hkv; ++bg) {
      T* pk = packs + bg * L.fwd_pack_elems();
      const int64_t off = (bg / Hkv) * Hkv * D + (bg % Hkv) * D;
      pack_panels(pk, k + off, L.ldk, L);
      pack_rows(pk + L.panel_elems(), v + off, L.ldk, L.N, L);
    }
    // (implicit barrier: packs complete)

    // Forward rows are independent, so tasks are (row block, b, run of hc heads): enough work
    // for every thread even at B = 1. A thread takes `per_grab` consecutive tasks at a time, so
    // it knows its next task and prefetches that task's query rows during this one.
    // Late row blocks see more keys: hand them out first so the dynamic schedule ends level.
    auto task_at = [&](int64_t task, int64_t& r, int64_t& b, int64_t& h0, int64_t& nh) {
      r = L.n_blocks - 1 - task / n_bc;
      b = (task % n_bc) / n_chunks;
      h0 = (task % n_bc) % n_chunks * hc;
      nh = std::min(Hq, h0 + hc) - h0;
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t grab = 0; grab < n_grabs; ++grab) {
      const int64_t t1 = std::min(n_tasks, (grab + 1) * per_grab);
      for (int64_t task = grab * per_grab; task < t1; ++task) {
        int64_t r, b, h0, nh, r_n = 0, b_n = 0, h0_n = 0, nh_n = 0;
        task_at(task, r, b, h0, nh);
        const bool has_next = task + 1 < t1;
        if (has_next) task_at(task + 1, r_n, b_n, h0_n, nh_n);
        const int64_t i0 = r * bk, m = std::min(S, i0 + bk) - i0;
        const int64_t off = (i0 * B + b) * Hq * D + h0 * D;
        const int64_t i0_n = r_n * bk, m_n = std::min(S, i0_n + bk) - i0_n;
        const int64_t off_n = (i0_n * B + b_n) * Hq * D + h0_n * D;
        pack_rows(Qc, q + off, L.ldq, m, L, nh, hs);
        Prefetcher pf;
        pf.add(out + off, L.ldq * int64_t{sizeof(T)}, m, nh * D * int64_t{sizeof(T)}, true);
        if (has_next) {
          pf.add(q + off_n, L.ldq * int64_t{sizeof(T)}, m_n, nh_n * D * int64_t{sizeof(T)});
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
          const int64_t h = h0 + hh;
          const T* pk = packs + (b * Hkv + h / L.group) * L.fwd_pack_elems();
          scores_any<T>(Qc + hh * hs, pk, scale, P, L, i0, m, pf);
          softmax_rows<T>(P, inv_sum, lse + (b * Hq + h) * s.lse_ld(), L, i0, m);
          if (dropout.on) dropout.apply(P, L, b, h, i0, m);  // after lse: it stays undropped
          rows_times_any<T>(P, pk + L.panel_elems(), inv_sum, Oc + hh * hs, L.Dp, L, i0, m, pf);
        }
        unpack_rows(out + off, Oc, L.ldq, m, L, nh, hs);
      }
    }
  }
}

// `out` is not read: delta = rowsum(dO * O) is taken as sum_j P_ij dP_ij (softmax_grad_rows).
// With dropout (FlashAttention's backward): out = (P o M) V, so dP is masked first,
// M o dP, and softmax_grad_rows gives dS = P o (M o dP - delta) with delta = sum_j P_ij (M o dP)_ij
// (still rowsum(dO * O)); then P is masked for dV = (P o M)^T dO. The bits are drawn twice
// rather than stored.
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, const AttentionShape& s, T* workspace,
                        const AttentionDropout* drop) {
  ScopedPhase phase(Phase::Attention);
  check_attention_shape(s, "attention");
  check_attention_dropout(drop, "attention");
  if (s.S == 0 || s.B == 0) return;
  MOE_CHECK(workspace != nullptr,
            "[attention] backward got no workspace: allocate attention_workspace_elems(shape, "
            "omp_get_max_threads()) elements before step 0");
  const Blocking L(s);
  const int64_t S = L.S, B = L.B, Hq = L.Hq, Hkv = L.Hkv, D = L.D, bk = L.bk;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(D)));
  const int n_threads = omp_get_max_threads();
  const int64_t hs = L.head_stride(), hs_d = round_up(bk, kLanes);
  T* packs = align64(workspace);
  T* slabs = packs + B * Hkv * L.fwd_pack_elems();
  const BlockDropout<T> dropout(drop, s);
  const bool block = s.is_block();  // delta from the merged out (a part of the row's keys)

#pragma omp parallel num_threads(n_threads)
  {
    T* Qc = slabs + omp_get_thread_num() * L.slab_elems();  // [hc][bk, Dp] queries
    T* dOc = Qc + kHeadsPerTask * hs;                       // [hc][bk, Dp] output gradients
    T* dQc = dOc + kHeadsPerTask * hs;                      // [hc][bk, Dp] query gradients
    T* P = dQc + kHeadsPerTask * hs;                        // [bk, Sp]
    T* dS = P + bk * L.Sp;                                  // [bk, Sp] dP, then scale * dS
    T* ones = dS + bk * L.Sp;                               // [bk] row scales of dQ = dS K
    std::fill(ones, ones + bk, T(1));
    // dK, dV of the task [S, Dp], contiguous: the rows of dk/dv are 4 KiB apart at the
    // benchmark shape, so the tiles' loads and stores of them all fell into the same cache sets.
    T* dKa = ones + kHeadsPerTask * hs_d;
    T* dVa = dKa + L.Sp * L.Dp;
    T* pk = dVa + L.Sp * L.Dp;  // K^T panels, V^T panels, K rows of the task's (b, kv head)
    // The block form's delta per row (rowsum(dO o O) of the merged output), in the slab's slack
    // after `ones` (kHeadsPerTask * hs_d elements, bk of them used): bk doubles fit in 2 hs_d.
    double* delta_r = reinterpret_cast<double*>(align64(ones + bk));

    // One task per (b, kv head): it alone writes that dK/dV slice (summed over the query heads
    // of the group) and the dQ of those query heads, in a fixed order (row block, then head)
    // -> deterministic. The heads of the group go in runs of up to kHeadsPerTask, packed
    // together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t bg = 0; bg < B * Hkv; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      T* dk_g = dk + b * Hkv * D + g * D;
      T* dv_g = dv + b * Hkv * D + g * D;
      // K^T and V^T panels (for Q K^T and dO V^T) and K rows (for dS K); only this task reads
      // them, so it packs them itself into its thread's slab.
      // K^T comes from the packed K rows (in cache) rather than from k again.
      pack_rows(pk + 2 * L.panel_elems(), k + (b * Hkv + g) * D, L.ldk, L.N, L);
      pack_panels(pk, pk + 2 * L.panel_elems(), L.Dp, L);
      pack_panels(pk + L.panel_elems(), v + (b * Hkv + g) * D, L.ldk, L);
      std::fill(dKa, dKa + 2 * L.Sp * L.Dp, T(0));  // dKa and dVa
      for (int64_t r = 0; r < L.n_blocks; ++r) {
        const int64_t i0 = r * bk, m = std::min(S, i0 + bk) - i0;
        for (int64_t h0 = g * L.group; h0 < (g + 1) * L.group; h0 += kHeadsPerTask) {
          const int64_t nh = std::min((g + 1) * L.group, h0 + kHeadsPerTask) - h0;
          const int64_t off = (i0 * B + b) * Hq * D + h0 * D;
          // The rows of the task's next run of heads (this block, else the next block's first)
          // are prefetched while this one computes.
          const bool next_r = h0 + nh == (g + 1) * L.group;
          const bool has_next = !next_r || r + 1 < L.n_blocks;
          const int64_t i0_next = next_r ? i0 + bk : i0, h0_next = next_r ? g * L.group : h0 + nh;
          const int64_t m_next = std::min(S, i0_next + bk) - i0_next;
          const int64_t nh_next = std::min((g + 1) * L.group, h0_next + kHeadsPerTask) - h0_next;
          const int64_t off_next = (i0_next * B + b) * Hq * D + h0_next * D;
          pack_rows(Qc, q + off, L.ldq, m, L, nh, hs);
          pack_rows(dOc, dout + off, L.ldq, m, L, nh, hs);
          Prefetcher pf;
          const int64_t row_bytes = L.ldq * int64_t{sizeof(T)};
          pf.add(dq + off, row_bytes, m, nh * D * int64_t{sizeof(T)}, true);
          if (has_next) {
            const int64_t n = nh_next * D * int64_t{sizeof(T)};
            pf.add(q + off_next, row_bytes, m_next, n);
            pf.add(dout + off_next, row_bytes, m_next, n);
          }
          for (int64_t hh = 0; hh < nh; ++hh) {
            const int64_t h = h0 + hh;
            // Scaled scores and dP = dO V^T, then P and dS in place.
            scores_any<T>(Qc + hh * hs, pk, scale, P, L, i0, m, pf);
            scores_any<T>(dOc + hh * hs, pk + L.panel_elems(), T(1), dS, L, i0, m, pf);
            if (dropout.on) dropout.apply(dS, L, b, h, i0, m);  // M o dP
            if (block) {  // delta of the merged output: rowsum(dO o O) over its D values
              for (int64_t rr = 0; rr < m; ++rr) {
                const T* o_r = out + off + rr * L.ldq + hh * D;
                const T* g_r = dout + off + rr * L.ldq + hh * D;
                double acc = 0.0;
                for (int64_t d = 0; d < D; ++d) {
                  acc += static_cast<double>(o_r[d]) * static_cast<double>(g_r[d]);
                }
                delta_r[rr] = acc;
              }
            }
            softmax_grad_rows<T>(P, dS, lse + (b * Hq + h) * s.lse_ld(), scale, L, i0, m,
                                 block ? delta_r : nullptr);
            if (dropout.on) dropout.apply(P, L, b, h, i0, m);              // P o M for dV
            cols_times_any<T>(P, dOc + hh * hs, dVa, L.Dp, L, i0, m, pf);  // dV += P^T dO
            cols_times_any<T>(dS, Qc + hh * hs, dKa, L.Dp, L, i0, m, pf);  // dK += dS^T Q
            rows_times_any<T>(dS, pk + 2 * L.panel_elems(), ones, dQc + hh * hs, L.Dp, L, i0, m,
                              pf);
          }
          unpack_rows(dq + off, dQc, L.ldq, m, L, nh, hs);
        }
      }
      unpack_rows(dk_g, dKa, L.ldk, L.N, L, 1, 0);
      unpack_rows(dv_g, dVa, L.ldk, L.N, L, 1, 0);
    }
  }
}

#define MOECORE_INSTANTIATE_ATTENTION(T)                                                          \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionShape&, \
                                     T*, const AttentionDropout*);                                \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,         \
                                      const T*, const T*, const AttentionShape&, T*,              \
                                      const AttentionDropout*);
MOECORE_INSTANTIATE_ATTENTION(float)
MOECORE_INSTANTIATE_ATTENTION(double)
#undef MOECORE_INSTANTIATE_ATTENTION

}  // namespace cpu
}  // namespace moecore::ops
