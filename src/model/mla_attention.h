// Multi-latent attention (DeepSeek-V2/V3; Megatron's MLASelfAttention), one tensor-parallel
// rank. Queries: x -> linear_q_down_proj [q_lora_rank] -> q_layernorm -> linear_q_up_proj, or one
// linear_q_proj without --q-lora-rank; per head [q_nope (qk) | q_pe (pe)]. Keys and values:
// x -> linear_kv_down_proj [kv_lora_rank | k_pe (pe)], the latent part -> kv_layernorm ->
// linear_kv_up_proj, per head [k_nope (qk) | v (dv)]; k_pe is rotated once and shared by every
// head. q_pe and k_pe are rotated by ops/rope_mla.h (interleaved pairs, plain or YaRN), the core
// attention is the causal op over heads padded to Dp = max(qk + pe, dv) (ops/mla_layout.h) with
// softmax scale MlaConfig::softmax_scale(), and linear_proj maps heads x dv back to H. The norms
// exist with --qk-layernorm only (Megatron's layer spec: identities otherwise), under moecore's
// names q_layernorm.weight / kv_layernorm.weight (TE's fused spelling is
// linear_q_up_proj.layer_norm_weight). Tokens are sequence-major (t = s * B + b at position s).
// Legend: S sequence, B micro-batch, T = S*B tokens, H hidden, Hq heads, ql q_lora_rank,
// kl kv_lora_rank, qk / pe / dv the head parts, dq = qk + pe, Dp = max(dq, dv).
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "model/config.h"
#include "nn/param_registry.h"
#include "ops/attention.h"
#include "ops/mla_layout.h"
#include "ops/rope_mla.h"

namespace moecore::model {

template <typename T>
struct MlaSaved {
  DevPtr<const T> x_TH = nullptr;  // block input (normed), the caller's until backward
  DevPtr<T> q_c = nullptr;         // [T, ql] linear_q_down_proj's output (with q LoRA)
  DevPtr<T> q_cn = nullptr;        // [T, ql] after q_layernorm (with --qk-layernorm)
  DevPtr<T> rstd_q = nullptr;      // [T]
  DevPtr<T> kv_c = nullptr;        // [T, kl] the latent part of linear_kv_down_proj
  DevPtr<T> kv_cn = nullptr;       // [T, kl] after kv_layernorm (with --qk-layernorm)
  DevPtr<T> rstd_kv = nullptr;     // [T]
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
  MlaAttention(const ModelConfig& cfg, ParamRegistry& params, const std::string& prefix,
               const ops::RopeMlaCache& rope);
  void allocate(Arena& arena, int64_t S, int64_t B);
  // Dropout on the attention probabilities (null: none); heads numbered from 0.
  void set_dropout(const ops::AttentionDropout* drop) { drop_ = drop; }
  // x, y: [T, H] (the input stays the caller's until backward).
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH);
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH);  // dx assigned, weight grads accumulated

 private:
  // linear_proj over the first dv of each padded head, and its backward.
  void proj_forward(DevPtr<T> y_TH, int64_t n);
  void proj_backward(DevPtr<const T> dy_TH, int64_t n);

  const Exec* ex_ = &cpu_exec();
  int64_t H_, Hq_, ql_, kl_, qk_, pe_, dvh_, dqh_, Dp_;  // dvh: dv, dqh: dq
  double eps_, q_scale_;
  const ops::RopeMlaCache& rope_;
  const ops::AttentionDropout* drop_ = nullptr;
  Param* q_down_ = nullptr;   // [ql, H] with q LoRA
  Param* q_norm_ = nullptr;   // [ql] with q LoRA and --qk-layernorm
  Param* q_up_ = nullptr;     // [Hq dq, ql], or linear_q_proj [Hq dq, H] without q LoRA
  Param* kv_down_ = nullptr;  // [kl + pe, H]
  Param* kv_norm_ = nullptr;  // [kl] with --qk-layernorm
  Param* kv_up_ = nullptr;    // [Hq (qk + dv), kl]
  Param* proj_ = nullptr;     // [H, Hq dv]
  ops::AttentionShape shape_;
  ops::MlaLayoutShape layout_;
  MlaSaved<T> saved_;
  DevPtr<int32_t> pos_T_ = nullptr;  // token positions (MemKind::State)
  DevPtr<T> q_up_TC_ = nullptr;      // [T, Hq, dq] the q projection / its gradient
  DevPtr<T> q_pe_ = nullptr;         // [T, Hq, pe] rotated / its gradient
  DevPtr<T> k_pe_raw_ = nullptr;     // [T, pe] linear_kv_down_proj's rotary rows / gradient
  DevPtr<T> k_pe_ = nullptr;         // [T, pe] rotated / its gradient
  DevPtr<T> kv_up_TC_ = nullptr;     // [T, Hq, qk + dv] / its gradient
  DevPtr<T> dlat_ = nullptr;         // [T, max(ql, kl)] a latent's gradient (before its norm)
  DevPtr<T> dlat_n_ = nullptr;       // [T, max(ql, kl)] (after its norm)
  DevPtr<T> dq_ = nullptr;           // [T, Hq, Dp]
  DevPtr<T> dk_ = nullptr;
  DevPtr<T> dv_ = nullptr;
  DevPtr<T> dcore_ = nullptr;
  DevPtr<T> workspace_ = nullptr;
};

}  // namespace moecore::model
