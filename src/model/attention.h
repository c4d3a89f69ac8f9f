// Self-attention block: fused QKV projection (Megatron's layout: per query group, its query
// heads then one key and one value head), RoPE on q and k, causal GQA core attention, output
// projection. Optional: a bias on the QKV projection (--add-qkv-bias) and RMSNorm of q and k
// over the head dim before RoPE (--qk-layernorm). Tokens are sequence-major: token t = s * B + b
// sits at position s. Legend: S sequence, B micro-batch, T = S*B tokens, H hidden, D head dim.
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "model/config.h"
#include "ops/attention.h"
#include "ops/rope.h"

namespace moecore::model {

template <typename T>
struct AttentionSaved {
  const T* x_TH = nullptr;  // block input (normed), owned by the caller until backward
  T* q_raw = nullptr;       // [S, B, Hq, D] before qk-layernorm (when enabled)
  T* k_raw = nullptr;       // [S, B, Hkv, D]
  T* rstd_q = nullptr;      // [S, B, Hq] qk-layernorm statistics
  T* rstd_k = nullptr;      // [S, B, Hkv]
  T* q = nullptr;           // [S, B, Hq, D] after RoPE
  T* k = nullptr;           // [S, B, Hkv, D] after RoPE
  T* v = nullptr;           // [S, B, Hkv, D]
  T* core_out = nullptr;    // [S, B, Hq, D]
  T* lse = nullptr;         // [B, Hq, S]
};

template <typename T>
class SelfAttention {
 public:
  SelfAttention(const ModelConfig& cfg, ParamRegistry& params, const std::string& prefix,
                const ops::RopeCache& rope);
  // With cfg.recompute's core_attn the attention core's out and lse are recomputed from q, k
  // and v at the start of the backward instead of kept (MemKind::Recomputed).
  void allocate(Arena& arena, int64_t S, int64_t B);
  // --bf16 on the widened GEMM path: the QKV GEMMs read the weights' widened copies, so an input
  // that already holds bf16 values (rmsnorm_forward_bf16w) needs no rounding pass; after
  // allocate(), the block says so with input_rounded() when widened_bf16().
  bool widened_bf16() const { return bf16_ && qkv_->has_data16w; }
  void input_rounded() { x_rounded_ = widened_bf16(); }
  void forward(T* y_TH, const T* x_TH);
  void backward(T* dx_TH, const T* dy_TH);  // dx assigned, weight grads accumulated

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // x_rounded: x holds bf16 values already (the QKV input after input_rounded()).
  void linear_forward(T* y, const T* x, const Param& w, int64_t M, int64_t N, int64_t K,
                      bool x_rounded = false);
  void linear_backward(T* dx, const T* dy, const T* x, const Param& w, int64_t M, int64_t N,
                       int64_t K, bool x_rounded = false);

  int64_t H_, Hq_, Hkv_, D_;
  const ops::RopeCache& rope_;
  Param* qkv_;                 // [(Hq + 2 Hkv) D, H]
  Param* qkv_bias_ = nullptr;  // [(Hq + 2 Hkv) D] with --add-qkv-bias
  Param* q_norm_ = nullptr;    // [D] with --qk-layernorm
  Param* k_norm_ = nullptr;    // [D]
  double eps_;
  bool recompute_core_;
  Param* proj_;  // [H, Hq D]
  ops::AttentionShape shape_;
  AttentionSaved<T> saved_;
  int32_t* pos_T_ = nullptr;  // token positions, filled once (MemKind::State)
  T* qkv_TC_ = nullptr;       // projection output / its gradient
  T* dq_ = nullptr;
  T* dk_ = nullptr;
  T* dv_ = nullptr;
  T* dcore_ = nullptr;
  T* workspace_ = nullptr;
  bool bf16_ = false;       // --bf16: bf16 GEMM inputs, f32 accumulation
  bool x_rounded_ = false;  // the block input arrives as bf16 values (input_rounded())
  bf16* in16_ = nullptr;    // --bf16 on the native path: the GEMM inputs cast to bf16
  bf16* dy16_ = nullptr;
  float* ws32_ = nullptr;  // --bf16 on the widen path: the GEMMs' f32 operands
};

}  // namespace moecore::model
