// The log-sum-exp merge of two partial attentions of the same queries over disjoint key sets
// (context parallelism's ring: one partial per block of keys, ops/attention.h's block form):
// lse' = log(exp(lse) + exp(lse_i)), out' = exp(lse - lse') out + exp(lse_i - lse') out_i, the
// FlashAttention online-softmax rescaling applied once per block. No backward: the backward of
// each block takes the merged out and lse (ops::attention_backward's block form) instead.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "core/host_device.h"
#include "ops/attention.h"

namespace moecore::ops {

// The weights of one row: w = exp(lse - lse'), w_i = exp(lse_i - lse'), lse' merged, in double
// (the body of every path; a side at -inf, no key seen, weighs 0).
MOE_HOST_DEVICE inline void attention_merge_weights(double lse, double lse_i, double& merged,
                                                    double& w, double& w_i) {
  const double m = lse > lse_i ? lse : lse_i;
  if (m == -std::numeric_limits<double>::infinity()) {
    merged = m, w = 0.0, w_i = 0.0;
    return;
  }
  const double a = std::exp(lse - m), a_i = std::exp(lse_i - m);
  merged = m + std::log(a + a_i);
  w = a / (a + a_i);
  w_i = a_i / (a + a_i);
}

// Throws naming `op` unless s.S, s.B >= 0, s.Hq, s.D > 0 and s.lse_ld() >= s.S.
void check_attention_merge_shape(const AttentionShape& s, const char* op);

namespace cpu {  // the CPU fast path (ops/cpu/): the switch below calls it
template <typename T>
void attention_merge(T* out, T* lse, const T* out_i, const T* lse_i, const AttentionShape& s);
}  // namespace cpu
// The CUDA kernel (ops/cuda/attention_merge.cu): a thread per (query row, b, head).
namespace cuda {
template <typename T>
void attention_merge(void* stream, T* out, T* lse, const T* out_i, const T* lse_i,
                     const AttentionShape& s);
}  // namespace cuda

// out, out_i [S, B, Hq, D]; lse, lse_i [B, Hq, s.lse_ld()] (the first S of each row, the same
// stride for both): (out, lse) <- merge of (out, lse) and (out_i, lse_i). Reads S, B, Hq, D and
// lse_ld() of s (the block's shape).
template <typename T>
void attention_merge(const Exec& ex, DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> out_i,
                     DevPtr<const T> lse_i, const AttentionShape& s) {
  if (ex.on_cpu())
    return cpu::attention_merge(raw_ptr(out), raw_ptr(lse), raw_ptr(out_i), raw_ptr(lse_i), s);
  return cuda::attention_merge(ex.stream, raw_ptr(out), raw_ptr(lse), raw_ptr(out_i),
                               raw_ptr(lse_i), s);
}
template <typename T>
void attention_merge_ref(T* out, T* lse, const T* out_i, const T* lse_i, const AttentionShape& s);

}  // namespace moecore::ops
