#include "model/attention.h"

#include <cstring>

#include "core/check.h"
#include "ops/bias.h"
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
  if (q_norm_ != nullptr) {
    saved_.q_raw = a.alloc<T>(n * Hq_ * D_, "attn.q_raw");
    saved_.k_raw = a.alloc<T>(n * Hkv_ * D_, "attn.k_raw");
    saved_.rstd_q = a.alloc<T>(n * Hq_, "attn.rstd_q");
    saved_.rstd_k = a.alloc<T>(n * Hkv_, "attn.rstd_k");
  }
  saved_.q = a.alloc<T>(n * Hq_ * D_, "attn.q");
  saved_.k = a.alloc<T>(n * Hkv_ * D_, "attn.k");
  saved_.v = a.alloc<T>(n * Hkv_ * D_, "attn.v");
  {
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, recompute_core_);
    saved_.core_out = a.alloc<T>(n * Hq_ * D_, "attn.core_out");
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
  const int64_t C = (Hq_ + 2 * Hkv_) * D_;
  lin_.allocate(a, *qkv_, {{n, C, H_}, {n, H_, Hq_ * D_}}, "attn");
  x_rounded_ = false;  // until the block says otherwise
  if (pos_T_ != nullptr) core_.positions(pos_T_);
}

template <typename T>
void SelfAttention<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH) {
  const int64_t n = shape_.S * shape_.B;
  saved_.x_TH = x_TH;
  const int64_t C = (Hq_ + 2 * Hkv_) * D_;
  const DevPtr<const T> x = tp_.enter(*ex_, x_TH, x_full_, n, H_);
  lin_.forward(qkv_TC_, x, *qkv_, n, C, H_, x_rounded_);
  if (qkv_bias_ != nullptr) ops::bias_forward(*ex_, qkv_TC_, qkv_bias_->compute_as<T>(), n, C);
  const ops::QkvShape qs{n, Hq_, Hkv_, D_};
  if (q_norm_ != nullptr) {
    ops::split_qkv(*ex_, saved_.q_raw, saved_.k_raw, saved_.v, qkv_TC_, qs);
    ops::rmsnorm_forward(*ex_, saved_.q, saved_.rstd_q, saved_.q_raw, q_norm_->compute_as<T>(),
                         n * Hq_, D_, eps_);
    ops::rmsnorm_forward(*ex_, saved_.k, saved_.rstd_k, saved_.k_raw, k_norm_->compute_as<T>(),
                         n * Hkv_, D_, eps_);
  } else {
    ops::split_qkv(*ex_, saved_.q, saved_.k, saved_.v, qkv_TC_, qs);
  }
  if (rope_on_) {
    ops::rope_forward(*ex_, saved_.q, saved_.q, pos_T_, n, Hq_, rope_);
    ops::rope_forward(*ex_, saved_.k, saved_.k, pos_T_, n, Hkv_, rope_);
  }
  core_.forward(saved_.core_out, saved_.lse, saved_.q, saved_.k, saved_.v, drop_);
  // The row-parallel projection's partial sum: into y itself without SP (the all-reduce is in
  // place), else into the whole-token buffer that is reduce-scattered into y.
  const DevPtr<T> partial = tp_.sequence_parallel() ? y_full_ : y_TH;
  lin_.forward(partial, saved_.core_out, *proj_, n, H_, Hq_ * D_);
  if (proj_bias_ != nullptr && tp_.rank() == 0)
    ops::bias_forward(*ex_, partial, proj_bias_->compute_as<T>(), n, H_);
  tp_.leave(*ex_, partial, y_TH, n, H_);
}

template <typename T>
void SelfAttention<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH) {
  const int64_t n = shape_.S * shape_.B;
  const ops::QkvShape qs{n, Hq_, Hkv_, D_};
  if (recompute_core_)
    core_.forward(saved_.core_out, saved_.lse, saved_.q, saved_.k, saved_.v, drop_);
  const DevPtr<const T> dy = tp_.leave_backward(*ex_, dy_TH, y_full_, n, H_);
  if (proj_bias_ != nullptr && tp_.rank() == 0)
    ops::bias_backward(*ex_, proj_bias_->grad_as<T>(), dy, n, H_);
  lin_.backward(dcore_, dy, saved_.core_out, *proj_, n, H_, Hq_ * D_);
  core_.backward(dq_, dk_, dv_, dcore_, saved_.q, saved_.k, saved_.v, saved_.core_out, saved_.lse,
                 drop_);
  if (rope_on_) {
    ops::rope_backward(*ex_, dq_, dq_, pos_T_, n, Hq_, rope_);
    ops::rope_backward(*ex_, dk_, dk_, pos_T_, n, Hkv_, rope_);
  }
  if (q_norm_ != nullptr) {
    // dq/dk now hold gradients w.r.t. the normed q/k; the core-attention buffers q/k are free
    // for the pre-norm gradients.
    ops::rmsnorm_backward(*ex_, saved_.q, q_norm_->grad_as<T>(), dq_, saved_.q_raw,
                          q_norm_->compute_as<T>(), saved_.rstd_q, n * Hq_, D_);
    ops::rmsnorm_backward(*ex_, saved_.k, k_norm_->grad_as<T>(), dk_, saved_.k_raw,
                          k_norm_->compute_as<T>(), saved_.rstd_k, n * Hkv_, D_);
    ops::fuse_qkv(*ex_, qkv_TC_, saved_.q, saved_.k, dv_, qs);
  } else {
    ops::fuse_qkv(*ex_, qkv_TC_, dq_, dk_, dv_, qs);
  }
  const int64_t C = (Hq_ + 2 * Hkv_) * D_;
  if (qkv_bias_ != nullptr) ops::bias_backward(*ex_, qkv_bias_->grad_as<T>(), qkv_TC_, n, C);
  // The forward's gathered input again (its workspace was the other layers' meanwhile), and the
  // input gradient's partial sum: into dx itself without SP, else into the free output buffer.
  const DevPtr<const T> x = tp_.enter(*ex_, saved_.x_TH, x_full_, n, H_);
  const DevPtr<T> dx = tp_.sequence_parallel() ? y_full_ : dx_TH;
  lin_.backward(dx, qkv_TC_, x, *qkv_, n, C, H_, x_rounded_);
  tp_.enter_backward(*ex_, dx, dx_TH, n, H_);
}

template class SelfAttention<float>;
template class SelfAttention<double>;

}  // namespace moecore::model
