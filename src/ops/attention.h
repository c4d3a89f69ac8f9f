// Causal self-attention core with grouped-query attention (GQA), after the projections and
// RoPE. Layout [S, B, heads, D] (sequence-major, as Megatron), scale 1/sqrt(D). Memory-frugal:
// the fast path materialises at most a 64 x S block of scores per thread, plus K and V repacked
// once per (b, kv head) (workspace below); the backward recomputes probabilities from the saved
// log-sum-exp. Attention dropout is fused: the probabilities are dropped tile by tile with keep
// bits drawn from their indices, so no mask is stored.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/dev_ptr.h"
#include "core/exec.h"
#include "ops/dropout.h"

namespace moecore::ops {

// The block form (context parallelism, parallel/context_parallel_attention.h): S queries at global
// positions q_offset .. q_offset + S - 1 against Sk keys at k_offset .. k_offset + Sk - 1, key j
// visible to query i iff k_offset + j <= q_offset + i. The forward gives the block's own out and
// lse (softmax over its visible keys), which ops/attention_merge.h combines across blocks; the
// backward takes the merged out and lse (the full softmax's) and gives the block's exact share
// of dq, dk, dv (FlashAttention-2: P = exp(s - lse), delta = rowsum(dO o O)). q_offset must be
// >= k_offset, so every query row sees at least the block's first key (a block whose rows see
// no key is skipped by the caller, never computed). The defaults are the whole causal sequence.
struct AttentionShape {
  int64_t S = 0, B = 0, Hq = 0, Hkv = 0, D = 0;  // Hq % Hkv == 0
  int64_t Sk = 0;                                // keys (0: S)
  int64_t q_offset = 0;                          // global position of query row 0
  int64_t k_offset = 0;                          // global position of key row 0
  int64_t lse_stride = 0;  // elements between the lse rows of (b, h) (0: S): lse [B, Hq, stride]
  // A --bf16 run's attention: on CUDA, where the start-up probe found cuDNN's fused attention and
  // the call is expressible (ops/desc/sdpa_desc.h), T = float calls are computed by cuDNN in bf16
  // (inputs rounded to bf16, f32 softmax and accumulation, outputs rounded to bf16 and widened;
  // docs/numerics.md). The CPU paths and the own CUDA kernel ignore it.
  bool bf16 = false;

  int64_t keys() const { return Sk == 0 ? S : Sk; }
  int64_t lse_ld() const { return lse_stride == 0 ? S : lse_stride; }
  // Whether the block's rows may see fewer keys than their causal prefix (then the backward
  // must be given the merged out and lse, and takes delta from them).
  bool is_block() const { return keys() != S || q_offset != 0 || k_offset != 0; }
};

// Dropout of the probabilities P[b, h, i, j] (after the causal softmax): kept iff
// dropout_keep(dropout_head_key(key, head0 + h), iteration, sample0 + b, q_offset + i,
// k_offset + j, dropout_threshold(p)) (global positions: a block draws the whole sequence's bits),
// iteration and sample0 read from *counters inside the op; then out = (P o M / (1 - p)) V. head0 is
// the global index of this rank's first query head, so a tensor-parallel split draws the whole
// model's bits. The saved lse stays that of the undropped scores; the backward redraws the same
// bits. p == 0 is no dropout (counters may then be null).
struct AttentionDropout {
  double p = 0;
  uint64_t key = 0;
  DevPtr<const DropoutCounters> counters = nullptr;
  int64_t head0 = 0;
};

// Throws naming `op` when the shape is impossible (negative sizes, Hq not a multiple of Hkv,
// q_offset < k_offset, lse_stride < S).
void check_attention_shape(const AttentionShape& s, const char* op);

// The attention path of a run, for its start-up log: "[attention] cuDNN fused (SDPA, cuDNN 9.19,
// frontend 1.32)" where a --bf16 run without attention dropout on CUDA takes cuDNN, otherwise
// "[attention] own kernel (why)". CUDA probes cuDNN once per process (cuda::cudnn_attention_probe).
std::string attention_path_line(const Exec& ex, bool bf16, double attention_dropout);

// Workspace elements (of T) the fast path needs for `n_threads` threads: about
// 2 * Sk * B * Hkv * D (packed K and V) + n_threads * (2 * 64 * Sk + 5 * Sk * D + 12 * 64 * D).
int64_t attention_workspace_elems(const AttentionShape& s, int n_threads);

namespace cpu {  // the CPU fast paths (ops/cpu/): the switch of each op below calls them
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, const AttentionShape& s,
                       T* workspace, const AttentionDropout* drop);
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, const AttentionShape& s, T* workspace,
                        const AttentionDropout* drop);
}  // namespace cpu
// The CUDA kernels (ops/cuda/attention.cu): a SIMT flash kernel, tiles of queries and keys in
// shared memory, the backward recomputing P from lse with delta = rowsum(dO o O) (FlashAttention-2)
// in two atomic-free kernels (dK/dV per key tile, dQ per query tile). They need no workspace.
// The dropout's exact keep bits; within the dtype's tolerance of the reference, bitwise run to
// run. `stream` is the context's; drop->counters in device memory.
namespace cuda {
template <typename T>
void attention_forward(void* stream, T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& s, const AttentionDropout* drop);
template <typename T>
void attention_backward(void* stream, T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                        const T* v, const T* out, const T* lse, const AttentionShape& s,
                        const AttentionDropout* drop);
// cuDNN's fused attention (ops/cuda/attention_cudnn.cpp in the CUDA build; the other builds have
// none): the probe says once per process whether it runs (available) and what ("cuDNN 9.19,
// frontend 1.32"), or why not. MOECORE_CUDNN_ATTENTION=0 turns it off. The calls return false,
// having enqueued nothing, when the call is not taken by cuDNN (not bf16, dropout, a shape the
// descriptor refuses or cuDNN does not support: each reason logged once); otherwise they cast
// the inputs to bf16 staging of the call's shape, run the cached graph on `stream` and widen the
// outputs. Graphs (and their staging and workspace) are built once per shape: by
// cudnn_attention_prepare before the first step, or at a shape's first call.
struct CudnnAttentionProbe {
  bool available = false;
  std::string text;
};
const CudnnAttentionProbe& cudnn_attention_probe();
void cudnn_attention_prepare(void* stream, const AttentionShape& s, const AttentionDropout* drop);
bool cudnn_attention_forward(void* stream, float* out, float* lse, const float* q, const float* k,
                             const float* v, const AttentionShape& s, const AttentionDropout* drop);
bool cudnn_attention_backward(void* stream, float* dq, float* dk, float* dv, const float* dout,
                              const float* q, const float* k, const float* v, const float* out,
                              const float* lse, const AttentionShape& s,
                              const AttentionDropout* drop);
}  // namespace cuda

// Builds what the call of this shape needs before the first step (cuDNN's graphs on CUDA under
// s.bf16); nothing on the CPU or for the own kernel.
inline void attention_prepare(const Exec& ex, const AttentionShape& s,
                              const AttentionDropout* drop) {
  if (!ex.on_cpu() && s.bf16) cuda::cudnn_attention_prepare(ex.stream, s, drop);
}

// q, out [S, B, Hq, D]; k, v [Sk, B, Hkv, D]; lse [B, Hq, lse_stride] (its first S of each row)
// saved for backward. drop: nullptr (or p == 0) for no dropout; the backward must get the
// forward's. In the block form the backward's out and lse are the merged ones (see above).
template <typename T>
void attention_forward(const Exec& ex, DevPtr<T> out, DevPtr<T> lse, DevPtr<const T> q,
                       DevPtr<const T> k, DevPtr<const T> v, const AttentionShape& s,
                       DevPtr<T> workspace, const AttentionDropout* drop) {
  if (ex.on_cpu())
    return cpu::attention_forward(raw_ptr(out), raw_ptr(lse), raw_ptr(q), raw_ptr(k), raw_ptr(v), s,
                                  raw_ptr(workspace), drop);
  if constexpr (std::is_same_v<T, float>) {
    if (s.bf16 && cuda::cudnn_attention_forward(ex.stream, raw_ptr(out), raw_ptr(lse), raw_ptr(q),
                                                raw_ptr(k), raw_ptr(v), s, drop))
      return;
  }
  return cuda::attention_forward(ex.stream, raw_ptr(out), raw_ptr(lse), raw_ptr(q), raw_ptr(k),
                                 raw_ptr(v), s, drop);
}
template <typename T>
void attention_forward_ref(T* out, T* lse, const T* q, const T* k, const T* v,
                           const AttentionShape& s, const AttentionDropout* drop);
// dq, dk, dv are assigned.
template <typename T>
void attention_backward(const Exec& ex, DevPtr<T> dq, DevPtr<T> dk, DevPtr<T> dv,
                        DevPtr<const T> dout, DevPtr<const T> q, DevPtr<const T> k,
                        DevPtr<const T> v, DevPtr<const T> out, DevPtr<const T> lse,
                        const AttentionShape& s, DevPtr<T> workspace,
                        const AttentionDropout* drop) {
  if (ex.on_cpu())
    return cpu::attention_backward(raw_ptr(dq), raw_ptr(dk), raw_ptr(dv), raw_ptr(dout), raw_ptr(q),
                                   raw_ptr(k), raw_ptr(v), raw_ptr(out), raw_ptr(lse), s,
                                   raw_ptr(workspace), drop);
  if constexpr (std::is_same_v<T, float>) {
    if (s.bf16 && cuda::cudnn_attention_backward(ex.stream, raw_ptr(dq), raw_ptr(dk), raw_ptr(dv),
                                                 raw_ptr(dout), raw_ptr(q), raw_ptr(k), raw_ptr(v),
                                                 raw_ptr(out), raw_ptr(lse), s, drop))
      return;
  }
  return cuda::attention_backward(ex.stream, raw_ptr(dq), raw_ptr(dk), raw_ptr(dv), raw_ptr(dout),
                                  raw_ptr(q), raw_ptr(k), raw_ptr(v), raw_ptr(out), raw_ptr(lse), s,
                                  drop);
}
template <typename T>
void attention_backward_ref(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                            const T* out, const T* lse, const AttentionShape& s,
                            const AttentionDropout* drop);

// Throws naming `op` unless drop is null or has 0 <= p < 1, and counters when p > 0.
void check_attention_dropout(const AttentionDropout* drop, const char* op);

}  // namespace moecore::ops
