#include "model/attention.h"

#include <cstring>
#include <string>
#include <type_traits>

#include "core/check.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/qkv_layout.h"
#include "ops/rmsnorm.h"

namespace moecore::model {

template <typename T>
SelfAttention<T>::SelfAttention(const ModelConfig& cfg, ParamRegistry& params,
                                const std::string& prefix, const ops::RopeCache& rope,
                                parallel::TensorParallel tp, parallel::ContextParallel cp)
    : tp_(tp),
      core_(cp),
      H_(cfg.hidden),
      Hq_(cfg.num_heads / tp.size()),
      Hkv_(cfg.num_query_groups / tp.size()),
      D_(cfg.head_dim()),
      rope_(rope),
      rope_on_(cfg.position_embedding == PositionEmbedding::Rope),
      eps_(cfg.norm_eps),
      recompute_core_(cfg.recompute.modules().core_attn),
      bf16_(cfg.bf16),
      prepare_core_(cfg.bf16 && cfg.attention_dropout == 0.0) {
  MOE_CHECK(cfg.num_query_groups % tp.size() == 0 && cfg.num_heads % tp.size() == 0,
            "[attention] {} attention heads in {} query groups cannot be split over {} "
            "tensor-parallel ranks: --tensor-model-parallel-size must divide "
            "--num-query-groups (and --num-attention-heads)",
            cfg.num_heads, cfg.num_query_groups, tp.size());
  const int64_t C = (cfg.num_heads + 2 * cfg.num_query_groups) * D_;  // global QKV rows
  const TpShard shard = tp.shard();
  // Replicated values whose gradient is this rank's part: the output projection's bias (added by
  // TP rank 0 only) and the qk-layernorm weights (each rank normalises its own heads).
  const TpRole partial = shard.partial();
  const TpRole sharded = shard.sharded();
  qkv_ = &params.add(ParamSpec{prefix + ".linear_qkv.weight",
                               {C, H_},
                               ParamInit::Normal,
                               cfg.init_std,
                               ParamKind::Dense,
                               true,
                               shard.slice(0, C),
                               /*bf16_only=*/true,
                               sharded});
  if (cfg.add_qkv_bias) {
    qkv_bias_ = &params.add(ParamSpec{prefix + ".linear_qkv.bias",
                                      {C},
                                      ParamInit::Zeros,
                                      0.0,
                                      ParamKind::Dense,
                                      false,
                                      shard.slice(0, C),
                                      false,
                                      sharded});
  }
  if (cfg.qk_layernorm) {
    q_norm_ = &params.add(ParamSpec{prefix + ".q_layernorm.weight", {D_}, ParamInit::Ones, 0.0,
                                    ParamKind::Dense, false, {}, false, partial});
    k_norm_ = &params.add(ParamSpec{prefix + ".k_layernorm.weight", {D_}, ParamInit::Ones, 0.0,
                                    ParamKind::Dense, false, {}, false, partial});
  }
  proj_ = &params.add(ParamSpec{prefix + ".linear_proj.weight",
                                {H_, cfg.num_heads * D_},
                                ParamInit::Normal,
                                cfg.output_init_std(),
                                ParamKind::Dense,
                                true,
                                shard.slice(1, cfg.num_heads * D_),
                                /*bf16_only=*/true,
                                sharded});
  if (cfg.add_attention_output_bias) {
    proj_bias_ = &params.add(ParamSpec{prefix + ".linear_proj.bias", {H_}, ParamInit::Zeros, 0.0,
                                       ParamKind::Dense, false, {}, false, partial});
  }
}

template <typename T>
void SelfAttention<T>::allocate(Arena& a, int64_t S, int64_t B) {
  ex_ = &a.exec();
  MOE_CHECK(!rope_on_ || S * core_.cp().size() <= rope_.max_pos || a.mode() == Arena::Mode::Plan,
            "[attention] sequence {} > RoPE table {}", S * core_.cp().size(), rope_.max_pos);
  shape_ = ops::AttentionShape{S, B, Hq_, Hkv_, D_};
  shape_.bf16 = bf16_;
  if (prepare_core_ && core_.cp().size() == 1 && a.mode() != Arena::Mode::Plan)
    ops::attention_prepare(a.exec(), shape_, nullptr);
  const int64_t n = S * B;
  // The projections' bf16 path (the test LinearGemms makes) decides the bf16 dataflow.
  store16_ = std::is_same_v<T, float> && qkv_->has_bf16_copy();
  saved_ = AttentionSaved<T>{};
  if (q_norm_ != nullptr) {
    saved_.q_raw = a.alloc<T>(n * Hq_ * D_, "attn.q_raw");
    saved_.k_raw = a.alloc<T>(n * Hkv_ * D_, "attn.k_raw");
    saved_.rstd_q = a.alloc<T>(n * Hq_, "attn.rstd_q");
    saved_.rstd_k = a.alloc<T>(n * Hkv_, "attn.rstd_k");
  }
  // A kept activation NAME of `elems`: under --bf16 a bf16 copy (NAME16) is kept and the f32 work
  // runs in a transient workspace (NAME32); otherwise the kept f32 buffer is the workspace too.
  const auto kept = [&](DevPtr<T>& f32, DevPtr<bf16>& copy16, int64_t elems,
                        const std::string& name) {
    if (!store16_) return f32 = a.alloc<T>(elems, name);
    copy16 = a.alloc<bf16>(elems, name + "16");
    return a.alloc<T>(elems, name + "32", MemKind::Workspace);
  };
  q_w_ = kept(saved_.q, saved_.q16, n * Hq_ * D_, "attn.q");
  k_w_ = kept(saved_.k, saved_.k16, n * Hkv_ * D_, "attn.k");
  v_w_ = kept(saved_.v, saved_.v16, n * Hkv_ * D_, "attn.v");
  {
    // With core_attn recomputed the backward recomputes the output from q, k, v into its f32
    // workspace and never reads the kept output: it is planned as recomputed (so the plan shrinks
    // by the reported saving) and, under --bf16, left unwritten.
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, recompute_core_);
    out_w_ = kept(saved_.core_out, saved_.out16, n * Hq_ * D_, "attn.core_out");
    saved_.lse = a.alloc<T>(B * Hq_ * S, "attn.lse");
  }
  pos_T_ = a.alloc<int32_t>(n, "attn.positions", MemKind::State);
  qkv_TC_ = a.alloc<T>(n * (Hq_ + 2 * Hkv_) * D_, "attn.qkv", MemKind::Workspace);
  dq_ = a.alloc<T>(n * Hq_ * D_, "attn.dq", MemKind::Workspace);
  dk_ = a.alloc<T>(n * Hkv_ * D_, "attn.dk", MemKind::Workspace);
  dv_ = a.alloc<T>(n * Hkv_ * D_, "attn.dv", MemKind::Workspace);
  dcore_ = a.alloc<T>(n * Hq_ * D_, "attn.dcore", MemKind::Workspace);
  core_.allocate(a, shape_, "attn");
  if (tp_.sequence_parallel()) {
    x_full_ = a.alloc<T>(n * H_, "attn.x_full", MemKind::Workspace);
    y_full_ = a.alloc<T>(n * H_, "attn.y_full", MemKind::Workspace);
  }
  // --bf16: the input (n1) feeds only the QKV GEMMs, which read its bf16 values: gathered as bf16
  // (the backward's output gradient through the same buffer, backward()).
  x_wire16_ = store16_ && tp_.sequence_parallel()
                  ? a.alloc<bf16>(tp_.enter_wire_elems(n, H_), "attn.x_wire16", MemKind::Workspace)
                  : DevPtr<bf16>(nullptr);
  const int64_t C = (Hq_ + 2 * Hkv_) * D_;
  lin_.allocate(a, *qkv_, {{n, C, H_}, {n, H_, Hq_ * D_}}, "attn");
  x_rounded_ = false;  // until the block says otherwise
  if (pos_T_ != nullptr) core_.positions(pos_T_);
}

namespace {
// --bf16: x (f32 storage) rounded to its bf16 values in place, where Megatron-Core's op writes
// bf16; the f32 work of the next op then reads exactly what a bf16 read would give it.
template <typename T>
void round_bf16(const Exec& ex, DevPtr<T> x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) ops::round_f32_to_bf16(ex, x, DevPtr<const float>(x), n);
}
template <typename T>
void store_bf16(const Exec& ex, DevPtr<bf16> y, DevPtr<const T> x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) ops::cast_f32_to_bf16(ex, y, x, n);
}
template <typename T>
void load_bf16(const Exec& ex, DevPtr<T> y, DevPtr<const bf16> x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) ops::cast_bf16_to_f32(ex, y, x, n);
}
}  // namespace

template <typename T>
void SelfAttention<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH) {
  const int64_t n = shape_.S * shape_.B;
  saved_.x_TH = x_TH;
  const int64_t C = (Hq_ + 2 * Hkv_) * D_;
  const DevPtr<const T> x = tp_.enter(*ex_, x_TH, x_full_, n, H_, x_wire16_);
  lin_.forward(qkv_TC_, x, *qkv_, n, C, H_, x_rounded_);
  if (qkv_bias_ != nullptr) ops::bias_forward(*ex_, qkv_TC_, qkv_bias_->compute_as<T>(), n, C);
  // --bf16: the QKV GEMM's output is bf16 (its bias added in the f32 epilogue, then rounded
  // once), computed here as the f32-output GEMM into the f32 workspace qkv_TC_ and a rounding
  // pass, bitwise what a bf16 epilogue computes on the CPU. The one place to switch to a
  // bf16-output GEMM (ops/gemm_bf16.h) when the projections have one.
  if (store16_) round_bf16(*ex_, qkv_TC_, n * C);
  const ops::QkvShape qs{n, Hq_, Hkv_, D_};
  if (q_norm_ != nullptr) {
    ops::split_qkv(*ex_, saved_.q_raw, saved_.k_raw, v_w_, qkv_TC_, qs);
    qk_norm_forward(q_w_, saved_.rstd_q, saved_.q_raw, *q_norm_, n * Hq_);
    qk_norm_forward(k_w_, saved_.rstd_k, saved_.k_raw, *k_norm_, n * Hkv_);
  } else {
    ops::split_qkv(*ex_, q_w_, k_w_, v_w_, qkv_TC_, qs);
  }
  if (rope_on_) {
    // RoPE reads bf16 values, computes in f32 and (--bf16) writes bf16.
    ops::rope_forward(*ex_, q_w_, q_w_, pos_T_, n, Hq_, rope_);
    ops::rope_forward(*ex_, k_w_, k_w_, pos_T_, n, Hkv_, rope_);
    if (store16_) {
      round_bf16(*ex_, q_w_, n * Hq_ * D_);
      round_bf16(*ex_, k_w_, n * Hkv_ * D_);
    }
  }
  if (store16_) {  // saved for the backward in bf16 (exact: they hold bf16 values)
    store_bf16(*ex_, saved_.q16, DevPtr<const T>(q_w_), n * Hq_ * D_);
    store_bf16(*ex_, saved_.k16, DevPtr<const T>(k_w_), n * Hkv_ * D_);
    store_bf16(*ex_, saved_.v16, DevPtr<const T>(v_w_), n * Hkv_ * D_);
  }
  core_.forward(out_w_, saved_.lse, q_w_, k_w_, v_w_, drop_);
  core_out_rounded();
  if (saved_.out16 != nullptr && !recompute_core_)
    store_bf16(*ex_, saved_.out16, DevPtr<const T>(out_w_), n * Hq_ * D_);
  // The row-parallel projection's partial sum: into y itself without SP (the all-reduce is in
  // place), else into the whole-token buffer that is reduce-scattered into y.
  const DevPtr<T> partial = tp_.sequence_parallel() ? y_full_ : y_TH;
  lin_.forward(partial, out_w_, *proj_, n, H_, Hq_ * D_, store16_);
  if (proj_bias_ != nullptr && tp_.rank() == 0)
    ops::bias_forward(*ex_, partial, proj_bias_->compute_as<T>(), n, H_);
  tp_.leave(*ex_, partial, y_TH, n, H_);
}

template <typename T>
void SelfAttention<T>::qk_norm_forward(DevPtr<T> y, DevPtr<T> rstd, DevPtr<const T> x,
                                       const Param& w, int64_t rows) {
  if constexpr (std::is_same_v<T, float>) {
    // --bf16: the norm writes bf16 (its f32 math rounded once), RoPE's input.
    if (store16_)
      return ops::rmsnorm_forward_bf16w(*ex_, y, rstd, x, w.compute_as<T>(), rows, D_, eps_);
  }
  ops::rmsnorm_forward(*ex_, y, rstd, x, w.compute_as<T>(), rows, D_, eps_);
}

template <typename T>
void SelfAttention<T>::core_out_rounded() {
  // --bf16: the core writes bf16 (f32 softmax and sums inside), the projection's input.
  if (store16_) round_bf16(*ex_, out_w_, shape_.S * shape_.B * Hq_ * D_);
}

template <typename T>
void SelfAttention<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH) {
  const int64_t n = shape_.S * shape_.B;
  const ops::QkvShape qs{n, Hq_, Hkv_, D_};
  if (store16_) {  // the core's f32 operands again (their workspaces were other layers')
    load_bf16(*ex_, q_w_, DevPtr<const bf16>(saved_.q16), n * Hq_ * D_);
    load_bf16(*ex_, k_w_, DevPtr<const bf16>(saved_.k16), n * Hkv_ * D_);
    load_bf16(*ex_, v_w_, DevPtr<const bf16>(saved_.v16), n * Hkv_ * D_);
    if (!recompute_core_) load_bf16(*ex_, out_w_, DevPtr<const bf16>(saved_.out16), n * Hq_ * D_);
  }
  if (recompute_core_) {
    core_.forward(out_w_, saved_.lse, q_w_, k_w_, v_w_, drop_);
    core_out_rounded();
  }
  // --bf16 without the output bias: only the output projection's bf16 GEMMs read the gathered
  // gradient, so it travels as bf16 (the bias gradient would sum its f32 values).
  const DevPtr<const T> dy = tp_.leave_backward(*ex_, dy_TH, y_full_, n, H_,
                                                proj_bias_ == nullptr ? x_wire16_ : nullptr);
  if (proj_bias_ != nullptr && tp_.rank() == 0)
    ops::bias_backward(*ex_, proj_bias_->grad_as<T>(), dy, n, H_);
  lin_.backward(dcore_, dy, out_w_, *proj_, n, H_, Hq_ * D_, store16_);
  core_.backward(dq_, dk_, dv_, dcore_, q_w_, k_w_, v_w_, out_w_, saved_.lse, drop_);
  // dq, dk, dv stay f32 (TE writes them in bf16): rounded, they moved the final weights of the
  // --bf16 TP x EP layout rows (MtpParity.LayoutsBf16) past their row; the QKV GEMM's backward
  // reads their bf16 values.
  if (rope_on_) {
    ops::rope_backward(*ex_, dq_, dq_, pos_T_, n, Hq_, rope_);
    ops::rope_backward(*ex_, dk_, dk_, pos_T_, n, Hkv_, rope_);
  }
  if (q_norm_ != nullptr) {
    // dq/dk now hold gradients w.r.t. the normed q/k; the core's q/k operands are free for the
    // pre-norm gradients.
    ops::rmsnorm_backward(*ex_, q_w_, q_norm_->grad_as<T>(), dq_, saved_.q_raw,
                          q_norm_->compute_as<T>(), saved_.rstd_q, n * Hq_, D_);
    ops::rmsnorm_backward(*ex_, k_w_, k_norm_->grad_as<T>(), dk_, saved_.k_raw,
                          k_norm_->compute_as<T>(), saved_.rstd_k, n * Hkv_, D_);
    ops::fuse_qkv(*ex_, qkv_TC_, q_w_, k_w_, dv_, qs);
  } else {
    ops::fuse_qkv(*ex_, qkv_TC_, dq_, dk_, dv_, qs);
  }
  const int64_t C = (Hq_ + 2 * Hkv_) * D_;
  if (qkv_bias_ != nullptr) ops::bias_backward(*ex_, qkv_bias_->grad_as<T>(), qkv_TC_, n, C);
  // The forward's gathered input again (its workspace was the other layers' meanwhile), and the
  // input gradient's partial sum: into dx itself without SP, else into the free output buffer.
  const DevPtr<const T> x = tp_.enter(*ex_, saved_.x_TH, x_full_, n, H_, x_wire16_);
  const DevPtr<T> dx = tp_.sequence_parallel() ? y_full_ : dx_TH;
  lin_.backward(dx, qkv_TC_, x, *qkv_, n, C, H_, x_rounded_);
  tp_.enter_backward(*ex_, dx, dx_TH, n, H_);
}

template class SelfAttention<float>;
template class SelfAttention<double>;

}  // namespace moecore::model
