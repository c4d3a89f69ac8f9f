// Multi-latent attention (DeepSeek-V2/V3; Megatron's MLASelfAttention). Queries: x ->
// linear_q_down_proj [q_lora_rank] -> q_layernorm -> linear_q_up_proj, or one linear_q_proj
// without --q-lora-rank; per head [q_nope (qk) | q_pe (pe)]. Keys and values: x ->
// linear_kv_down_proj [kv_lora_rank | k_pe (pe)], the latent part -> kv_layernorm ->
// linear_kv_up_proj, per head [k_nope (qk) | v (dv)]; k_pe is rotated once and shared by every
// head. q_pe and k_pe are rotated by ops/rope_mla.h (interleaved pairs, plain or YaRN), the core
// attention is the causal op over heads padded to Dp = max(qk + pe, dv) (ops/mla_layout.h) with
// softmax scale MlaConfig::softmax_scale(), and linear_proj maps heads x dv back to H. The norms
// exist with --qk-layernorm only (Megatron's layer spec: identities otherwise), under moecore's
// names q_layernorm.weight / kv_layernorm.weight (TE's fused spelling is
// linear_q_up_proj.layer_norm_weight). linear_proj has a bias with --add-attention-output-bias
// (Megatron's --add-bias-linear: its MLA has no other). Tokens are sequence-major (t = s * B + b
// at position s).
// Tensor parallelism (parallel/tensor_parallel.h), Megatron's split: the down projections and
// their norms are replicated and run on the tokens this rank holds between TP regions (its
// sequence slice with --sequence-parallel, all tokens without); the latents (q's, kv's and the
// raw rotary key k_pe) then enter the TP region, all-gathered over TP with SP, and the up
// projections (linear_q_up_proj / linear_q_proj, linear_kv_up_proj) are column-parallel over the
// heads (a rank's Hq / tp heads are a contiguous slice of their rows), linear_proj row-parallel
// over heads x dv; k_pe is rotated on every rank. Without q LoRA, linear_q_proj reads x itself:
// x enters the region (all-gathered with SP) for it. The latents' gradients leave the region
// reduce-scattered (SP) or all-reduced (without SP) before the norms' and down projections'
// backward, so those weights' gradients are partial sums over TP with SP (each rank's tokens:
// TpRole ReplicatedPartialGrad) and whole on every rank without it (Replicated). Why the latents
// enter the region and not x (as in SelfAttention): they are narrower than x (DeepSeek-V3:
// 1536 + 512 + 64 values a token against 7168), so the all-gathers and reduce-scatters move
// under a third of the values, and with SP the down projections run once per token over the TP
// group instead of once on every rank.
// Legend: S sequence, B micro-batch, T = S*B tokens, Tl = tp.local_tokens(T) the tokens held
// between TP regions, H hidden, Hq this rank's heads, ql q_lora_rank, kl kv_lora_rank,
// qk / pe / dv the head parts, dq = qk + pe, Dp = max(dq, dv).
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "model/config.h"
#include "nn/linear_gemms.h"
#include "nn/param_registry.h"
#include "ops/attention.h"
#include "ops/mla_layout.h"
#include "ops/rope_mla.h"
#include "parallel/context_parallel.h"
#include "parallel/context_parallel_attention.h"
#include "parallel/tensor_parallel.h"

namespace moecore::model {

template <typename T>
struct MlaSaved {
  DevPtr<const T> x_TH = nullptr;  // [Tl, H] block input (normed), the caller's until backward
  DevPtr<T> q_c = nullptr;         // [Tl, ql] linear_q_down_proj's output (with q LoRA)
  DevPtr<T> q_cn = nullptr;        // [Tl, ql] after q_layernorm (with --qk-layernorm)
  DevPtr<T> rstd_q = nullptr;      // [Tl]
  DevPtr<T> kv_c = nullptr;        // [Tl, kl] the latent part of linear_kv_down_proj
  DevPtr<T> kv_cn = nullptr;       // [Tl, kl] after kv_layernorm (with --qk-layernorm)
  DevPtr<T> rstd_kv = nullptr;     // [Tl]
  DevPtr<T> q = nullptr;           // [T, Hq, Dp] the core attention's inputs (ops/mla_layout.h)
  DevPtr<T> k = nullptr;
  DevPtr<T> v = nullptr;
  DevPtr<T> core_out = nullptr;  // [T, Hq, Dp]
  DevPtr<T> lse = nullptr;       // [B, Hq, S]
};

template <typename T>
class MlaAttention {
 public:
  // rope: tables of cfg.mla.rope_spec(cfg.rotary_base) for at least S positions.
  // tp: the attention grid's TP group (parallel::TensorParallel::attention; default one rank).
  // cp: the attention grid's CP group and --cp-comm-type (default one rank): the core attention
  // runs across it (parallel/context_parallel_attention.h), RoPE takes the rows' global positions.
  MlaAttention(const ModelConfig& cfg, ParamRegistry& params, const std::string& prefix,
               const ops::RopeMlaCache& rope, parallel::TensorParallel tp = {},
               parallel::ContextParallel cp = {});
  // S, B: the micro-batch's sequence on this CP rank (2 C: the whole sequence / cp) and batch.
  // Selective recomputation (cfg.recompute's modules): with core_attn the core's out and lse, with
  // mla_up_proj q, k and v (the up projections, the rotary and the layout, from the saved latents)
  // are recomputed at the start of the backward instead of kept (MemKind::Recomputed); either, both
  // or none. Bitwise the backward without recomputation: the same operations on the same values.
  void allocate(Arena& arena, int64_t S, int64_t B);
  // --bf16 on the widened GEMM path: the down projections (and linear_q_proj) read the block
  // input through the weights' widened copies, so an input that already holds bf16 values needs
  // no rounding pass; after allocate(), the block says so with input_rounded().
  bool widened_bf16() const { return lin_.widened(); }
  void input_rounded() { x_rounded_ = widened_bf16(); }
  // --bf16 with T = float, after allocate(): the block input is read only by bf16 GEMMs (the
  // down projections), so the block may keep it in bf16 (TransformerBlock).
  bool reads_input_as_bf16() const { return lin_.bf16(); }
  // Dropout on the attention probabilities (null: none). The caller owns *drop; its head0 must
  // be first_head().
  void set_dropout(const ops::AttentionDropout* drop) { drop_ = drop; }
  // The global index of this rank's first head.
  int64_t first_head() const { return tp_.share_offset(Hq_ * tp_.size()); }
  // x, y: [tp.local_tokens(T), H] (the input stays the caller's until backward).
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH);
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH);  // dx assigned, weight grads accumulated

 private:
  // The up projections' inputs over the whole TP region: q's latent (or x without q LoRA) and
  // kv's latent, all-gathered with SP (the saved values themselves without), and with `k_pe`
  // the raw rotary key too.
  void gather_latents(bool k_pe);
  // From the gathered latents: the up projections, the rotary parts and mla_split's q, k, v.
  void up_forward();
  // linear_proj over the first dv of each padded head, and its backward.
  void proj_forward(DevPtr<T> y_TH, int64_t n);
  void proj_backward(DevPtr<const T> dy_TH, int64_t n);

  const Exec* ex_ = &cpu_exec();
  // The projections: GEMMs in T, or bf16 inputs with f32 accumulation under --bf16.
  nn::LinearGemms<T> lin_;
  DevPtr<bf16> lat_wire16_ = nullptr;  // --bf16 with SP: the latents' bf16 all-gathers' staging
  bool x_rounded_ = false;  // the block input arrives as bf16 values (input_rounded())
  parallel::TensorParallel tp_;
  // The core attention (forward, its recomputation, backward): the plain op on one CP rank.
  parallel::ContextParallelAttention<T> core_;
  int64_t H_, Hq_, ql_, kl_, qk_, pe_, dvh_, dqh_, Dp_;  // Hq: this rank's; dvh: dv, dqh: dq
  int64_t n_ = 0, nl_ = 0;                               // T and Tl
  double eps_, q_scale_;
  const ops::RopeMlaCache& rope_;
  bool recompute_core_, recompute_up_;  // core_attn, mla_up_proj
  bool bf16_;          // --bf16: the core may take cuDNN's fused attention (shape_.bf16)
  bool prepare_core_;  // --bf16 without attention dropout: its graphs built in allocate()
  const ops::AttentionDropout* drop_ = nullptr;
  Param* q_down_ = nullptr;   // [ql, H] with q LoRA
  Param* q_norm_ = nullptr;   // [ql] with q LoRA and --qk-layernorm
  Param* q_up_ = nullptr;     // [Hq dq, ql], or linear_q_proj [Hq dq, H] without q LoRA
  Param* kv_down_ = nullptr;  // [kl + pe, H]
  Param* kv_norm_ = nullptr;  // [kl] with --qk-layernorm
  Param* kv_up_ = nullptr;    // [Hq (qk + dv), kl]
  Param* proj_ = nullptr;     // [H, Hq dv]
  Param* proj_bias_ = nullptr;  // [H] with --add-attention-output-bias (--add-bias-linear)
  ops::AttentionShape shape_;
  ops::MlaLayoutShape layout_;
  MlaSaved<T> saved_;
  DevPtr<int32_t> pos_T_ = nullptr;  // token positions (MemKind::State)
  DevPtr<T> k_pe_raw_ = nullptr;     // [Tl, pe] linear_kv_down_proj's rotary rows
  // gather_latents(): the up projections' inputs [T, .] (the gathered copies below with SP, the
  // saved values otherwise).
  DevPtr<const T> q_in_ = nullptr, kv_in_ = nullptr, k_pe_in_ = nullptr;
  DevPtr<T> q_up_TC_ = nullptr;    // [T, Hq, dq] the q projection / its gradient
  DevPtr<T> q_pe_ = nullptr;       // [T, Hq, pe] rotated / its gradient
  DevPtr<T> k_pe_ = nullptr;       // [T, pe] rotated / its gradient
  DevPtr<T> kv_up_TC_ = nullptr;   // [T, Hq, qk + dv] / its gradient
  DevPtr<T> dk_pe_raw_ = nullptr;  // [Tl, pe] the raw rotary key's gradient
  DevPtr<T> dlat_ = nullptr;       // [Tl, max(ql, kl)] a latent's gradient (before its norm)
  DevPtr<T> dlat_n_ = nullptr;     // [Tl, max(ql, kl)] (after its norm)
  DevPtr<T> dq_ = nullptr;         // [T, Hq, Dp]
  DevPtr<T> dk_ = nullptr;
  DevPtr<T> dv_ = nullptr;
  DevPtr<T> dcore_ = nullptr;
  // With sequence parallelism (null otherwise): the gathered latents [T, ql], [T, kl], [T, pe]
  // (gathered again in the backward), x gathered for linear_q_proj without q LoRA [T, H], a
  // latent's gradient over the whole region [T, max(ql, kl)] before its reduce-scatter, and the
  // output projection's partial [T, H] (then the gathered output gradient, then linear_q_proj's
  // input gradient).
  DevPtr<T> q_in_full_ = nullptr;
  DevPtr<T> kv_in_full_ = nullptr;
  DevPtr<T> k_pe_full_ = nullptr;
  DevPtr<T> x_full_ = nullptr;
  DevPtr<T> dlat_full_ = nullptr;
  DevPtr<T> y_full_ = nullptr;
};

}  // namespace moecore::model
