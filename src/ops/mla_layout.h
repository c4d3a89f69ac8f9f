// Multi-latent attention's q, k and v for the core attention op, which takes one head width Dp for
// all three: Dp = max(qk + pe, dv) (qk: the un-rotated part of a q / k head, pe: the rotated part,
// dv: a value head). mla_split assembles, per token t and head h,
//   q[t, h] = c [q_up[t, h, 0:qk] | q_pe[t, h] | 0 ...],
//   k[t, h] = [kv_up[t, h, 0:qk] | k_pe[t] | 0 ...]   (k_pe: one rotated key part for all heads),
//   v[t, h] = [kv_up[t, h, qk:qk+dv] | 0 ...],
// the zero tails leaving q.k and P v unchanged; c scales q so that the op's 1 / sqrt(Dp) becomes
// the wanted softmax scale (c = scale sqrt(Dp); exactly 1 for DeepSeek-V3's shapes without
// YaRN's mscale). mla_merge is its transpose: dq_up's first qk of each head, dq_pe, dkv_up and
// dk_pe = sum over the heads (in head order) of dk's rotated part; everything assigned.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

struct MlaLayoutShape {
  int64_t n_tok = 0, heads = 0, qk = 0, pe = 0, dv = 0;
  int64_t dq() const { return qk + pe; }                // q_up's head width
  int64_t dkv() const { return qk + dv; }               // kv_up's head width
  int64_t Dp() const { return std::max(qk + pe, dv); }  // the attention's head width
};

// Throws naming `op` unless every size is >= 0 and pe, dv >= 1.
void check_mla_layout_shape(const MlaLayoutShape& s, const char* op);

namespace cpu {
template <typename T>
void mla_split(T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up, const T* k_pe,
               const MlaLayoutShape& s, double q_scale);
template <typename T>
void mla_merge(T* dq_up, T* dq_pe, T* dkv_up, T* dk_pe, const T* dq, const T* dk, const T* dv,
               const MlaLayoutShape& s, double q_scale);
}  // namespace cpu
// The CUDA kernels (ops/cuda/mla_layout.cu): a thread per output element, bitwise the CPU path.
namespace cuda {
template <typename T>
void mla_split(void* stream, T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up,
               const T* k_pe, const MlaLayoutShape& s, double q_scale);
template <typename T>
void mla_merge(void* stream, T* dq_up, T* dq_pe, T* dkv_up, T* dk_pe, const T* dq, const T* dk,
               const T* dv, const MlaLayoutShape& s, double q_scale);
}  // namespace cuda

// q, k, v [n, heads, Dp]; q_up [n, heads, dq] (its first qk of each head read); q_pe [n, heads,
// pe]; kv_up [n, heads, dkv]; k_pe [n, pe].
template <typename T>
void mla_split(const Exec& ex, DevPtr<T> q, DevPtr<T> k, DevPtr<T> v, DevPtr<const T> q_up,
               DevPtr<const T> q_pe, DevPtr<const T> kv_up, DevPtr<const T> k_pe,
               const MlaLayoutShape& s, double q_scale) {
  if (ex.on_cpu())
    return cpu::mla_split(raw_ptr(q), raw_ptr(k), raw_ptr(v), raw_ptr(q_up), raw_ptr(q_pe),
                          raw_ptr(kv_up), raw_ptr(k_pe), s, q_scale);
  return cuda::mla_split(ex.stream, raw_ptr(q), raw_ptr(k), raw_ptr(v), raw_ptr(q_up),
                         raw_ptr(q_pe), raw_ptr(kv_up), raw_ptr(k_pe), s, q_scale);
}
template <typename T>
void mla_split_ref(T* q, T* k, T* v, const T* q_up, const T* q_pe, const T* kv_up, const T* k_pe,
                   const MlaLayoutShape& s, double q_scale);
// dq_up: only the first qk of each head is written (the rotated part is rope_mla_backward's).
template <typename T>
void mla_merge(const Exec& ex, DevPtr<T> dq_up, DevPtr<T> dq_pe, DevPtr<T> dkv_up, DevPtr<T> dk_pe,
               DevPtr<const T> dq, DevPtr<const T> dk, DevPtr<const T> dv, const MlaLayoutShape& s,
               double q_scale) {
  if (ex.on_cpu())
    return cpu::mla_merge(raw_ptr(dq_up), raw_ptr(dq_pe), raw_ptr(dkv_up), raw_ptr(dk_pe),
                          raw_ptr(dq), raw_ptr(dk), raw_ptr(dv), s, q_scale);
  return cuda::mla_merge(ex.stream, raw_ptr(dq_up), raw_ptr(dq_pe), raw_ptr(dkv_up), raw_ptr(dk_pe),
                         raw_ptr(dq), raw_ptr(dk), raw_ptr(dv), s, q_scale);
}
template <typename T>
void mla_merge_ref(T* dq_up, T* dq_pe, T* dkv_up, T* dk_pe, const T* dq, const T* dk, const T* dv,
                   const MlaLayoutShape& s, double q_scale);

}  // namespace moecore::ops
