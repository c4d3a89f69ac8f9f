// Causal self-attention core with grouped-query attention (GQA), after the projections and
// RoPE. Layout [S, B, heads, D] (sequence-major, as Megatron), scale 1/sqrt(D). Memory-frugal:
// the fast path materialises at most a 64 x S block of scores per thread, plus K and V repacked
// once per (b, kv head) (workspace below); the backward recomputes probabilities from the saved
// log-sum-exp.
#pragma once

#include <cstdint>

#include "core/dev_ptr.h"
#include "core/exec.h"

namespace moecore::ops {

struct AttentionShape {
  int64_t S = 0, B = 0, Hq = 0, Hkv = 0, D = 0;  // Hq % Hkv == 0
};

// Throws naming `op` when the shape is impossible (negative sizes, Hq not a multiple of Hkv).
void check_attention_shape(const AttentionShape& s, const char* op);

// Workspace elements (of T) the fast path needs for `n_threads` threads: about
// 2 * S * B * Hkv * D (packed K and V) + n_threads * (2 * 64 * S + 5 * S * D + 12 * 64 * D).
int64_t attention_workspace_elems(const AttentionShape& s, int n_threads);

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, const AttentionShape& s,
                       T* workspace);
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, const AttentionShape& s, T* workspace);
}  // namespace cpu

// q, out [S, B, Hq, D]; k, v [S, B, Hkv, D]; lse [B, Hq, S] saved for backward.
template <typename T>
void attention_forward(const Exec& ex, DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q,
                       DevPtr<const T> k, DevPtr<const T> v, const AttentionShape& s,
                       DevPtr<T> workspace) {
  if (ex.on_cpu())
    return cpu::attention_forward(raw_ptr(out), raw_ptr(lse), raw_ptr(q), raw_ptr(k), raw_ptr(v), s,
                                  raw_ptr(workspace));
  no_kernel(ex, "attention_forward");
}
template <typename T>
void attention_forward_ref(T* out, T* lse, const T* q, const T* k, const T* v,
                           const AttentionShape& s);
// dq, dk, dv are assigned.
template <typename T>
void attention_backward(const Exec& ex, DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv,
                        DevPtr<const T> dout, DevPtr<const T> q, DevPtr<const T> k,
                        DevPtr<const T> v, DevPtr<const T> out, DevPtr<const T> lse,
                        const AttentionShape& s, DevPtr<T> workspace) {
  if (ex.on_cpu())
    return cpu::attention_backward(raw_ptr(dq), raw_ptr(dk), raw_ptr(dv), raw_ptr(dout), raw_ptr(q),
                                   raw_ptr(k), raw_ptr(v), raw_ptr(out), raw_ptr(lse), s,
                                   raw_ptr(workspace));
  no_kernel(ex, "attention_backward");
}
template <typename T>
void attention_backward_ref(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                            const T* out, const T* lse, const AttentionShape& s);

}  // namespace moecore::ops
