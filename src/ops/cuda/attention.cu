// Causal GQA flash attention on the GPU, SIMT (no tensor cores: the grid emulator runs it), also
// in the block form of ops/attention.h (keys at an offset, the masks and dropout bits at global
// positions). The forward: a block per (b, query head, tile of queries); K and V tiles staged in shared memory,
// the online softmax over the key tiles up to the diagonal, a thread per query row for the
// running max and sum (its keys in order), lse saved as the CPU's (natural log of the undropped
// scaled scores' exp-sum). The backward recomputes P from lse (FlashAttention-2) with
// delta_i = rowsum(dO o O) computed in the block from the forward's out (no workspace): one kernel
// per (b, kv head, key tile) accumulates dK and dV over every query head of the group and every
// query tile, one per (b, query head, query tile) accumulates dQ. No atomics: every output has
// one writer and a fixed order of terms, so the same bits run to run; within the dtype's
// tolerance of the reference (the sums' order differs). The fused dropout draws each keep bit with
// ops::dropout_keep from (head key, iteration, sample, i, j), the counters read from device
// memory: the CPU's exact mask.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "ops/attention.h"
#include "ops/cuda/launch.cuh"

namespace moecore::ops::cuda {

namespace kernels {

struct Dims {
  int64_t S, B, Hq, Hkv, D;
  int64_t tile;  // queries per query tile and keys per key tile
  // The block form (ops/attention.h): N keys, query row i sees key j iff j <= i + shift
  // (shift = q_offset - k_offset); dropout drawn at (q_offset + i, k_offset + j); lse rows lse_ld
  // apart. The whole sequence: N = S, shift = q_offset = k_offset = 0, lse_ld = S.
  // The backward's delta is always rowsum(dO o O) of the given out: right for a block too.
  int64_t N, shift, q_offset, k_offset, lse_ld;
};

// Query row i sees key j.
__device__ __forceinline__ bool visible(const Dims& m, int64_t i, int64_t j) {
  return i < m.S && j < m.N && j <= i + m.shift;
}
// Keys [0, key_end(m, end)) meet some query row before `end`.
__device__ __forceinline__ int64_t key_end(const Dims& m, int64_t end) {
  return std::min(end + m.shift, m.N);
}

// The dropout of the probabilities; on == false: none (counters unread).
template <typename T>
struct Drop {
  bool on;
  uint64_t key;
  int64_t head0;
  uint32_t threshold;
  T scale;
  const DropoutCounters* counters;
};

// The factor of P[b, h, i, j] (head_key: dropout_head_key of the global head): scale or 0. The
// bit of ops::dropout_keep, its word picked by a select: dropout_keep's runtime index into the
// four words would place them in local memory.
template <typename T>
__device__ __forceinline__ T keep_factor(const Drop<T>& dr, uint64_t head_key, uint64_t iteration,
                                         uint64_t sample, int64_t i, int64_t j) {
  const std::array<uint32_t, 4> w =
      dropout_words(head_key, iteration, sample, uint64_t(i), uint64_t(j) / 4);
  const int64_t c = j % 4;
  const uint32_t word = c == 0 ? w[0] : c == 1 ? w[1] : c == 2 ? w[2] : w[3];
  return word >= dr.threshold ? dr.scale : T(0);
}

template <typename T>
__device__ __forceinline__ T dot(const T* a, const T* b, int64_t D) {
  T acc = 0;
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

// Rows [row0, row0 + n) of a [rows, B, H, D] tensor at (b, h) into shared [n][D] (rows past
// `rows`: 0).
template <typename T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int64_t row0, int64_t n,
                                          const Dims& m, int64_t H, int64_t b, int64_t h,
                                          int64_t rows) {
  for (int64_t e = threadIdx.x; e < n * m.D; e += blockDim.x) {
    const int64_t r = e / m.D, d = e % m.D, i = row0 + r;
    dst[e] = i < rows ? src[((i * m.B + b) * H + h) * m.D + d] : T(0);
  }
}

// Dynamic shared memory: Q, O [tile][D], K, V [tile][D], P, M [tile][tile], max, sum, correction
// [tile].
template <typename T>
__global__ void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, Dims m,
                                  T scale, Drop<T> dr) {
  const int64_t bt = m.tile, D = m.D, n_qt = (m.S + bt - 1) / bt;
  const int64_t q0 = (blockIdx.x % n_qt) * bt, bh = blockIdx.x / n_qt;
  const int64_t b = bh / m.Hq, h = bh % m.Hq, g = h / (m.Hq / m.Hkv);
  T* Qs = dynamic_shared<T>();
  T* Os = Qs + bt * D;
  T* Ks = Os + bt * D;
  T* Vs = Ks + bt * D;
  T* Ps = Vs + bt * D;
  T* Ms = Ps + bt * bt;
  T* mx_s = Ms + bt * bt;
  T* sum_s = mx_s + bt;
  T* corr_s = sum_s + bt;
  const T kNegInf = -std::numeric_limits<T>::infinity();
  uint64_t head_key = 0, iteration = 0, sample = 0;
  if (dr.on) {
    head_key = dropout_head_key(dr.key, uint64_t(dr.head0 + h));
    iteration = uint64_t(dr.counters->iteration);
    sample = uint64_t(dr.counters->sample0 + b);
  }
  load_rows(Qs, q, q0, bt, m, m.Hq, b, h, m.S);
  for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) Os[e] = T(0);
  for (int64_t r = threadIdx.x; r < bt; r += blockDim.x) mx_s[r] = kNegInf, sum_s[r] = T(0);
  // Keys [0, k_end) meet some query of the tile.
  const int64_t k_end = key_end(m, std::min(q0 + bt, m.S));
  for (int64_t k0 = 0; k0 < k_end; k0 += bt) {
    __syncthreads();  // the previous tile's K, V, P read
    load_rows(Ks, k, k0, bt, m, m.Hkv, b, g, m.N);
    load_rows(Vs, v, k0, bt, m, m.Hkv, b, g, m.N);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < bt * bt; e += blockDim.x) {
      const int64_t r = e / bt, c = e % bt, i = q0 + r, j = k0 + c;
      T score = kNegInf, f = T(0);
      if (visible(m, i, j)) {
        score = dot(Qs + r * D, Ks + c * D, D) * scale;
        f = dr.on ? keep_factor(dr, head_key, iteration, sample, m.q_offset + i, m.k_offset + j)
                  : T(1);
      }
      Ps[e] = score;
      Ms[e] = f;
    }
    __syncthreads();
    for (int64_t r = threadIdx.x; r < bt; r += blockDim.x) {
      T* p = Ps + r * bt;
      T mx = mx_s[r];
      for (int64_t c = 0; c < bt; ++c) mx = std::max(mx, p[c]);
      T corr = T(1), sum = T(0);
      if (mx == kNegInf) {  // a row past S: nothing to weigh
        for (int64_t c = 0; c < bt; ++c) p[c] = T(0);
      } else {
        corr = std::exp(mx_s[r] - mx);  // 0 on the first tile (-inf)
        for (int64_t c = 0; c < bt; ++c) {
          p[c] = std::exp(p[c] - mx);  // 0 for masked keys
          sum += p[c];
        }
      }
      sum_s[r] = sum_s[r] * corr + sum;  // undropped: lse is the undropped scores'
      mx_s[r] = mx;
      corr_s[r] = corr;
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      T acc = Os[e] * corr_s[r];
      for (int64_t c = 0; c < bt; ++c) acc += Ps[r * bt + c] * Ms[r * bt + c] * Vs[c * D + d];
      Os[e] = acc;
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D, i = q0 + r;
    if (i < m.S) out[((i * m.B + b) * m.Hq + h) * D + d] = Os[e] / sum_s[r];
  }
  for (int64_t r = threadIdx.x; r < bt; r += blockDim.x) {
    const int64_t i = q0 + r;
    if (i < m.S) lse[(b * m.Hq + h) * m.lse_ld + i] = mx_s[r] + std::log(sum_s[r]);
  }
}

// lse and delta = rowsum(dO o O) of query rows [q0, q0 + tile) of head h (rows past S: 0).
template <typename T>
__device__ __forceinline__ void load_row_stats(T* lse_s, T* delta_s, const T* lse, const T* dout,
                                               const T* out, int64_t q0, const Dims& m, int64_t b,
                                               int64_t h) {
  for (int64_t r = threadIdx.x; r < m.tile; r += blockDim.x) {
    const int64_t i = q0 + r;
    T l = T(0), delta = T(0);
    if (i < m.S) {
      const int64_t row = ((i * m.B + b) * m.Hq + h) * m.D;
      l = lse[(b * m.Hq + h) * m.lse_ld + i];
      delta = dot(dout + row, out + row, m.D);
    }
    lse_s[r] = l;
    delta_s[r] = delta;
  }
}

// P o M and dS = P o (M o dP - delta) of one (query tile, key tile) into Ps, dSs [tile][tile]
// (0 outside the causal triangle and past S).
template <typename T>
__device__ __forceinline__ void probs_and_grads(T* Ps, T* dSs, const T* Qs, const T* dOs,
                                                const T* Ks, const T* Vs, const T* lse_s,
                                                const T* delta_s, int64_t q0, int64_t k0,
                                                const Dims& m, T scale, const Drop<T>& dr,
                                                uint64_t head_key, uint64_t iteration,
                                                uint64_t sample) {
  const int64_t bt = m.tile, D = m.D;
  for (int64_t e = threadIdx.x; e < bt * bt; e += blockDim.x) {
    const int64_t r = e / bt, c = e % bt, i = q0 + r, j = k0 + c;
    T pm = T(0), ds = T(0);
    if (visible(m, i, j)) {
      const T p = std::exp(dot(Qs + r * D, Ks + c * D, D) * scale - lse_s[r]);
      const T f = dr.on ? keep_factor(dr, head_key, iteration, sample, m.q_offset + i,
                                      m.k_offset + j)
                        : T(1);
      const T dp = dot(dOs + r * D, Vs + c * D, D);
      pm = p * f;
      ds = p * (f * dp - delta_s[r]);
    }
    Ps[e] = pm;
    dSs[e] = ds;
  }
}

// Dynamic shared memory: K, V, dK, dV [tile][D], Q, dO [tile][D], P o M, dS [tile][tile], lse,
// delta [tile].
template <typename T>
__global__ void attention_backward_dkdv(T* dk, T* dv, const T* dout, const T* q, const T* k,
                                        const T* v, const T* out, const T* lse, Dims m, T scale,
                                        Drop<T> dr) {
  const int64_t bt = m.tile, D = m.D, n_kt = (m.N + bt - 1) / bt;
  const int64_t k0 = (blockIdx.x % n_kt) * bt, bg = blockIdx.x / n_kt;
  const int64_t b = bg / m.Hkv, g = bg % m.Hkv, qpg = m.Hq / m.Hkv;
  T* Ks = dynamic_shared<T>();
  T* Vs = Ks + bt * D;
  T* dKs = Vs + bt * D;
  T* dVs = dKs + bt * D;
  T* Qs = dVs + bt * D;
  T* dOs = Qs + bt * D;
  T* Ps = dOs + bt * D;
  T* dSs = Ps + bt * bt;
  T* lse_s = dSs + bt * bt;
  T* delta_s = lse_s + bt;
  load_rows(Ks, k, k0, bt, m, m.Hkv, b, g, m.N);
  load_rows(Vs, v, k0, bt, m, m.Hkv, b, g, m.N);
  for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) dKs[e] = T(0), dVs[e] = T(0);
  // The first query tile with a row that sees key k0 (row i sees it iff i >= k0 - shift).
  const int64_t q_start = std::max<int64_t>(0, k0 - m.shift) / bt * bt;
  const uint64_t iteration = dr.on ? uint64_t(dr.counters->iteration) : 0;
  const uint64_t sample = dr.on ? uint64_t(dr.counters->sample0 + b) : 0;
  for (int64_t hh = 0; hh < qpg; ++hh) {
    const int64_t h = g * qpg + hh;
    const uint64_t head_key = dr.on ? dropout_head_key(dr.key, uint64_t(dr.head0 + h)) : 0;
    for (int64_t q0 = q_start; q0 < m.S; q0 += bt) {  // query tiles that see the key tile
      __syncthreads();                                // the previous tile's Q, dO, P, dS read
      load_rows(Qs, q, q0, bt, m, m.Hq, b, h, m.S);
      load_rows(dOs, dout, q0, bt, m, m.Hq, b, h, m.S);
      load_row_stats(lse_s, delta_s, lse, dout, out, q0, m, b, h);
      __syncthreads();
      probs_and_grads(Ps, dSs, Qs, dOs, Ks, Vs, lse_s, delta_s, q0, k0, m, scale, dr, head_key,
                      iteration, sample);
      __syncthreads();
      for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) {
        const int64_t c = e / D, d = e % D;
        T acc_v = dVs[e], acc_k = dKs[e];
        for (int64_t r = 0; r < bt; ++r) {
          acc_v += Ps[r * bt + c] * dOs[r * D + d];
          acc_k += dSs[r * bt + c] * Qs[r * D + d];
        }
        dVs[e] = acc_v;
        dKs[e] = acc_k;
      }
    }
  }
  // Each element's last writer is the thread that writes it out: no barrier needed.
  for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) {
    const int64_t c = e / D, d = e % D, j = k0 + c;
    if (j < m.N) {
      const int64_t at = ((j * m.B + b) * m.Hkv + g) * D + d;
      dk[at] = dKs[e] * scale;
      dv[at] = dVs[e];
    }
  }
}

// Dynamic shared memory: Q, dO, dQ [tile][D], K, V [tile][D], P o M (unused), dS [tile][tile],
// lse, delta [tile].
template <typename T>
__global__ void attention_backward_dq(T* dq, const T* dout, const T* q, const T* k, const T* v,
                                      const T* out, const T* lse, Dims m, T scale, Drop<T> dr) {
  const int64_t bt = m.tile, D = m.D, n_qt = (m.S + bt - 1) / bt;
  const int64_t q0 = (blockIdx.x % n_qt) * bt, bh = blockIdx.x / n_qt;
  const int64_t b = bh / m.Hq, h = bh % m.Hq, g = h / (m.Hq / m.Hkv);
  T* Qs = dynamic_shared<T>();
  T* dOs = Qs + bt * D;
  T* dQs = dOs + bt * D;
  T* Ks = dQs + bt * D;
  T* Vs = Ks + bt * D;
  T* Ps = Vs + bt * D;
  T* dSs = Ps + bt * bt;
  T* lse_s = dSs + bt * bt;
  T* delta_s = lse_s + bt;
  uint64_t head_key = 0, iteration = 0, sample = 0;
  if (dr.on) {
    head_key = dropout_head_key(dr.key, uint64_t(dr.head0 + h));
    iteration = uint64_t(dr.counters->iteration);
    sample = uint64_t(dr.counters->sample0 + b);
  }
  load_rows(Qs, q, q0, bt, m, m.Hq, b, h, m.S);
  load_rows(dOs, dout, q0, bt, m, m.Hq, b, h, m.S);
  load_row_stats(lse_s, delta_s, lse, dout, out, q0, m, b, h);
  for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) dQs[e] = T(0);
  const int64_t k_end = key_end(m, std::min(q0 + bt, m.S));
  for (int64_t k0 = 0; k0 < k_end; k0 += bt) {
    __syncthreads();  // the previous tile's K and dS read (and Q, dO, lse, delta loaded)
    load_rows(Ks, k, k0, bt, m, m.Hkv, b, g, m.N);
    load_rows(Vs, v, k0, bt, m, m.Hkv, b, g, m.N);
    __syncthreads();
    probs_and_grads(Ps, dSs, Qs, dOs, Ks, Vs, lse_s, delta_s, q0, k0, m, scale, dr, head_key,
                    iteration, sample);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      T acc = dQs[e];
      for (int64_t c = 0; c < bt; ++c) acc += dSs[r * bt + c] * Ks[c * D + d];
      dQs[e] = acc;
    }
  }
  for (int64_t e = threadIdx.x; e < bt * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D, i = q0 + r;
    if (i < m.S) dq[((i * m.B + b) * m.Hq + h) * D + d] = dQs[e] * scale;
  }
}

}  // namespace kernels

namespace {

constexpr int kThreads = 128;
// Static and default dynamic shared memory per block without the opt-in attribute: 48 KB.
constexpr size_t kMaxSharedBytes = 48 * 1024;
constexpr int64_t kTiles[] = {16, 8, 4};

// Shared-memory bytes of each kernel at tile t (see the kernels' layouts).
template <typename T>
size_t forward_bytes(int64_t t, int64_t D) {
  return size_t(4 * t * D + 2 * t * t + 3 * t) * sizeof(T);
}
template <typename T>
size_t backward_bytes(int64_t t, int64_t D) {  // the larger of the two kernels: dK/dV's
  return size_t(6 * t * D + 2 * t * t + 2 * t) * sizeof(T);
}

std::string shape_text(const AttentionShape& s) {
  return "S=" + std::to_string(s.S) + " B=" + std::to_string(s.B) + " Hq=" + std::to_string(s.Hq) +
         " Hkv=" + std::to_string(s.Hkv) + " D=" + std::to_string(s.D);
}

// The largest tile whose shared memory fits, or a located error naming D.
template <typename T>
int64_t choose_tile(const AttentionShape& s, size_t (*bytes)(int64_t, int64_t), const char* op) {
  for (int64_t t : kTiles)
    if (bytes(t, s.D) <= kMaxSharedBytes) return t;
  MOE_KERNEL_CHECK(false, std::string("[") + op + "] head dim D=" + std::to_string(s.D) +
                              " needs " + std::to_string(bytes(kTiles[2], s.D)) +
                              " bytes of shared memory at the smallest tile (over " +
                              std::to_string(kMaxSharedBytes) +
                              "): use a head dim of at most 128 (f64) or 256 (f32)");
  return 0;
}

kernels::Dims dims(const AttentionShape& s, int64_t tile) {
  return kernels::Dims{s.S,        s.B,        s.Hq,       s.Hkv,
                       s.D,        tile,       s.keys(),   s.q_offset - s.k_offset,
                       s.q_offset, s.k_offset, s.lse_ld()};
}

template <typename T>
kernels::Drop<T> device_drop(const AttentionDropout* drop) {
  kernels::Drop<T> d{false, 0, 0, 0, T(1), nullptr};
  if (drop == nullptr || drop->p == 0.0) return d;
  d.on = true;
  d.key = drop->key;
  d.head0 = drop->head0;
  d.threshold = dropout_threshold(drop->p);
  d.scale = dropout_scale<T>(drop->p);
  d.counters = raw_ptr(drop->counters);
  return d;
}

// Validates the shape and the dropout and returns the launch's grid size for `heads` heads.
int64_t check_and_count(const AttentionShape& s, const AttentionDropout* drop, int64_t tile,
                        int64_t heads, const char* op) {
  check_attention_shape(s, op);
  check_attention_dropout(drop, op);
  const int64_t blocks = (s.S + tile - 1) / tile * s.B * heads;
  MOE_KERNEL_CHECK(blocks <= 0x7fffffff, std::string("[") + op + "] " + shape_text(s) + " needs " +
                                             std::to_string(blocks) +
                                             " blocks (over 2^31-1): split the batch");
  return blocks;
}

}  // namespace

template <typename T>
void attention_forward(void* stream, T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& s, const AttentionDropout* drop) {
  const int64_t tile = choose_tile<T>(s, forward_bytes<T>, "attention_forward");
  const int64_t blocks = check_and_count(s, drop, tile, s.Hq, "attention_forward");
  if (blocks == 0) return;
  const kernels::Dims m = dims(s, tile);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(s.D)));
  launch("attention_forward", kernels::attention_forward<T>, dim3(unsigned(blocks)), dim3(kThreads),
         forward_bytes<T>(tile, s.D), stream, out, lse, q, k, v, m, scale, device_drop<T>(drop));
}

template <typename T>
void attention_backward(void* stream, T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                        const T* v, const T* out, const T* lse, const AttentionShape& s,
                        const AttentionDropout* drop) {
  const int64_t tile = choose_tile<T>(s, backward_bytes<T>, "attention_backward");
  const int64_t blocks_q = check_and_count(s, drop, tile, s.Hq, "attention_backward");
  if (blocks_q == 0) return;
  const int64_t blocks_kv = (s.keys() + tile - 1) / tile * s.B * s.Hkv;
  const kernels::Dims m = dims(s, tile);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(s.D)));
  const kernels::Drop<T> dr = device_drop<T>(drop);
  const size_t smem = backward_bytes<T>(tile, s.D);
  launch("attention_backward_dkdv", kernels::attention_backward_dkdv<T>, dim3(unsigned(blocks_kv)),
         dim3(kThreads), smem, stream, dk, dv, dout, q, k, v, out, lse, m, scale, dr);
  launch("attention_backward_dq", kernels::attention_backward_dq<T>, dim3(unsigned(blocks_q)),
         dim3(kThreads), smem, stream, dq, dout, q, k, v, out, lse, m, scale, dr);
}

#define MOECORE_INSTANTIATE_ATTENTION_CUDA(T)                                                    \
  template void attention_forward<T>(void*, T*, T*, const T*, const T*, const T*,                \
                                     const AttentionShape&, const AttentionDropout*);            \
  template void attention_backward<T>(void*, T*, T*, T*, const T*, const T*, const T*, const T*, \
                                      const T*, const T*, const AttentionShape&,                 \
                                      const AttentionDropout*);
MOECORE_INSTANTIATE_ATTENTION_CUDA(float)
MOECORE_INSTANTIATE_ATTENTION_CUDA(double)
#undef MOECORE_INSTANTIATE_ATTENTION_CUDA

}  // namespace moecore::ops::cuda
