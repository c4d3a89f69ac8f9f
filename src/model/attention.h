// Self-attention block: fused QKV projection (Megatron's layout: per query group, its query
// heads then one key and one value head), RoPE on q and k, causal GQA core attention, output
// projection. Optional: a bias on the QKV projection (--add-qkv-bias), one on the output
// projection (--add-attention-output-bias) and RMSNorm of q and k over the head dim before RoPE
// (--qk-layernorm). Tokens are sequence-major: token t = s * B + b sits at position s.
// Tensor parallelism (parallel/tensor_parallel.h): the heads and query groups are split over the
// TP ranks (Hq / tp query heads, Hkv / tp groups each; Megatron's per-group layout makes a rank's
// groups a contiguous slice of the QKV rows); QKV is column-parallel, the output projection
// row-parallel (its bias added by TP rank 0 only). The layer enters its TP region on its input
// (tp.local_tokens(T) tokens: all-gathered with sequence parallelism) and leaves it on its output
// (reduce-scattered with SP, all-reduced without). The legend's Hq and Hkv are this rank's.
// Context parallelism (parallel/context_parallel.h): the layer holds this CP rank's 2 C of the
// sequence's positions (S below is that local length); the core attention runs across the cp
// group (parallel/context_parallel_attention.h) and RoPE takes the rows' global positions.
// Legend: S sequence, B micro-batch, T = S*B tokens, H hidden, D head dim.
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "core/dtype.h"
#include "model/config.h"
#include "nn/linear_gemms.h"
#include "nn/param_registry.h"
#include "ops/attention.h"
#include "ops/rope.h"
#include "parallel/context_parallel.h"
#include "parallel/context_parallel_attention.h"
#include "parallel/tensor_parallel.h"

namespace moecore::model {

template <typename T>
struct AttentionSaved {
  DevPtr<const T> x_TH = nullptr;  // block input (normed), owned by the caller until backward
  DevPtr<T> q_raw = nullptr;       // [S, B, Hq, D] before qk-layernorm (when enabled)
  DevPtr<T> k_raw = nullptr;       // [S, B, Hkv, D]
  DevPtr<T> rstd_q = nullptr;      // [S, B, Hq] qk-layernorm statistics
  DevPtr<T> rstd_k = nullptr;      // [S, B, Hkv]
  DevPtr<T> q = nullptr;           // [S, B, Hq, D] after RoPE
  DevPtr<T> k = nullptr;           // [S, B, Hkv, D] after RoPE
  DevPtr<T> v = nullptr;           // [S, B, Hkv, D]
  DevPtr<T> core_out = nullptr;    // [S, B, Hq, D]
  DevPtr<T> lse = nullptr;         // [B, Hq, S]
  // --bf16 (T = float): q, k, v and the core's output are kept in bf16 instead of the four
  // above (which stay null), as Megatron-Core keeps them; the core's output only when it is
  // not recomputed. lse stays f32 (the softmax statistics, as TE's).
  DevPtr<bf16> q16 = nullptr;    // [S, B, Hq, D] after RoPE
  DevPtr<bf16> k16 = nullptr;    // [S, B, Hkv, D] after RoPE
  DevPtr<bf16> v16 = nullptr;    // [S, B, Hkv, D]
  DevPtr<bf16> out16 = nullptr;  // [S, B, Hq, D]
};

template <typename T>
class SelfAttention {
 public:
  // tp: the attention grid's TP group (parallel::TensorParallel::attention; default one rank).
  // cp: the attention grid's CP group and --cp-comm-type (default one rank: the plain op).
  SelfAttention(const ModelConfig& cfg, ParamRegistry& params, const std::string& prefix,
                const ops::RopeCache& rope, parallel::TensorParallel tp = {},
                parallel::ContextParallel cp = {});
  // With cfg.recompute's core_attn the attention core's out and lse are recomputed from q, k
  // and v at the start of the backward instead of kept (MemKind::Recomputed). S: this rank's
  // local length (2 C under context parallelism, the global length / cp).
  void allocate(Arena& arena, int64_t S, int64_t B);
  // --bf16 on the widened GEMM path: the QKV GEMMs read the weights' widened copies, so an input
  // that already holds bf16 values (rmsnorm_forward_bf16w) needs no rounding pass; after
  // allocate(), the block says so with input_rounded() when widened_bf16().
  bool widened_bf16() const { return lin_.widened(); }
  void input_rounded() { x_rounded_ = widened_bf16(); }
  // --bf16 with T = float, after allocate(): q, k, v and the core's output kept in bf16
  // (AttentionSaved); the projections read bf16 inputs.
  bool stores_bf16() const { return store16_; }
  // Dropout on the attention probabilities of the next forward, its recomputation and its
  // backward (null: none). The caller owns *drop.
  // Its head0 must be first_head().
  void set_dropout(const ops::AttentionDropout* drop) { drop_ = drop; }
  // The global index of this rank's first query head.
  int64_t first_head() const { return tp_.share_offset(Hq_ * tp_.size()); }
  // x, y: [tp.local_tokens(T), H] (the input stays the caller's until backward).
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH);
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH);  // dx assigned, weight grads accumulated

 private:
  // q or k normed over the head dim (--qk-layernorm), written as bf16 values under store16_.
  void qk_norm_forward(DevPtr<T> y, DevPtr<T> rstd, DevPtr<const T> x, const Param& w,
                       int64_t rows);
  // out_w_ rounded to bf16 values under store16_ (the core's bf16 output).
  void core_out_rounded();

  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // The projections: GEMMs in T, or bf16 inputs with f32 accumulation under --bf16.
  nn::LinearGemms<T> lin_;

  parallel::TensorParallel tp_;
  // The core attention (forward, its recomputation, backward): the plain op on one CP rank.
  parallel::ContextParallelAttention<T> core_;
  int64_t H_, Hq_, Hkv_, D_;  // Hq_, Hkv_: this rank's
  const ops::RopeCache& rope_;
  bool rope_on_;  // --position-embedding-type rope
  const ops::AttentionDropout* drop_ = nullptr;
  Param* qkv_;                 // [(Hq + 2 Hkv) D, H]
  Param* qkv_bias_ = nullptr;  // [(Hq + 2 Hkv) D] with --add-qkv-bias
  Param* q_norm_ = nullptr;    // [D] with --qk-layernorm
  Param* k_norm_ = nullptr;    // [D]
  double eps_;
  bool recompute_core_;
  Param* proj_;  // [H, Hq D]
  Param* proj_bias_ = nullptr;  // [H] with --add-attention-output-bias
  ops::AttentionShape shape_;
  bool bf16_;          // --bf16: the core may take cuDNN's fused attention (shape_.bf16)
  bool prepare_core_;  // --bf16 without attention dropout: its graphs built in allocate()
  // --bf16 with T = float (the projections' bf16 path): the bf16 dataflow below.
  bool store16_ = false;
  AttentionSaved<T> saved_;
  // The core's f32 operands: saved_'s q, k, v, core_out, or under store16_ transient workspaces
  // holding the bf16 values of q16, k16, v16, out16 (written by the forward, widened again in
  // the backward): the core computes in f32 on bf16 values, as a kernel reading bf16 would.
  DevPtr<T> q_w_ = nullptr;
  DevPtr<T> k_w_ = nullptr;
  DevPtr<T> v_w_ = nullptr;
  DevPtr<T> out_w_ = nullptr;
  DevPtr<int32_t> pos_T_ = nullptr;  // token positions, filled once (MemKind::State)
  DevPtr<T> qkv_TC_ = nullptr;       // projection output / its gradient
  DevPtr<T> dq_ = nullptr;
  DevPtr<T> dk_ = nullptr;
  DevPtr<T> dv_ = nullptr;
  DevPtr<T> dcore_ = nullptr;
  // With sequence parallelism: the gathered input [T, H] (gathered again in the backward) and
  // the output projection's partial [T, H] (then the gathered output gradient, then the input
  // gradient's partial sum). Null otherwise.
  DevPtr<T> x_full_ = nullptr;
  DevPtr<T> y_full_ = nullptr;
  // --bf16 with SP: the bf16 staging of the input's all-gather (TensorParallel::enter).
  DevPtr<bf16> x_wire16_ = nullptr;
  bool x_rounded_ = false;  // the block input arrives as bf16 values (input_rounded())
};

}  // namespace moecore::model
