#include "model/mla_attention.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "ops/bias.h"
#include "ops/memory.h"
#include "ops/rmsnorm.h"

namespace moecore::model {

template <typename T>
MlaAttention<T>::MlaAttention(const ModelConfig& cfg, ParamRegistry& params,
                              const std::string& prefix, const ops::RopeMlaCache& rope,
                              parallel::TensorParallel tp, parallel::ContextParallel cp)
    : tp_(tp),
      core_(cp),
      H_(cfg.hidden),
      Hq_(cfg.num_heads / tp.size()),
      ql_(cfg.mla.q_lora_rank),
      kl_(cfg.mla.kv_lora_rank),
      qk_(cfg.mla.qk_head_dim),
      pe_(cfg.mla.qk_pos_emb_head_dim),
      dvh_(cfg.mla.v_head_dim),
      dqh_(cfg.mla.q_head_dim()),
      Dp_(std::max(cfg.mla.q_head_dim(), cfg.mla.v_head_dim)),
      eps_(cfg.norm_eps),
      // The core op scales by 1 / sqrt(Dp): q times c gives MLA's scale (c = 1 when Dp = dq and
      // no mscale).
      q_scale_(cfg.mla.softmax_scale() *
               std::sqrt(static_cast<double>(std::max(cfg.mla.q_head_dim(), cfg.mla.v_head_dim)))),
      rope_(rope),
      recompute_core_(cfg.recompute.modules().core_attn),
      recompute_up_(cfg.recompute.modules().mla_up_proj),
      bf16_(cfg.bf16),
      prepare_core_(cfg.bf16 && cfg.attention_dropout == 0.0) {
  cfg.mla.validate();
  MOE_CHECK(cfg.num_heads >= 1, "[mla] --num-attention-heads={} must be >= 1", cfg.num_heads);
  MOE_CHECK(cfg.num_heads % tp.size() == 0,
            "[mla] {} attention heads cannot be split over {} tensor-parallel ranks: "
            "--tensor-model-parallel-size must divide --num-attention-heads",
            cfg.num_heads, tp.size());
  MOE_CHECK(cfg.normalization == Normalization::RMSNorm || !cfg.qk_layernorm,
            "[mla] q_layernorm and kv_layernorm are RMSNorms here: use --normalization RMSNorm");
  const int64_t heads = cfg.num_heads, dkv = qk_ + dvh_;
  const TpShard shard = tp.shard();
  // The down projections and the latents' norms see the tokens this rank holds between TP
  // regions: partial gradients with SP only (the class comment).
  const TpRole replicated = tp.token_role();
  auto weight = [&](const std::string& name, std::vector<int64_t> shape, double std,
                    ParamSlice slice, TpRole role) {
    return &params.add(ParamSpec{prefix + "." + name, std::move(shape), ParamInit::Normal, std,
                                 ParamKind::Dense, true, slice, /*bf16_only=*/true, role});
  };
  auto norm = [&](const std::string& name, int64_t d) {
    return &params.add(ParamSpec{prefix + "." + name, {d}, ParamInit::Ones, 0.0, ParamKind::Dense,
                                 false, {}, false, replicated});
  };
  // Column-parallel over the heads: rows [h dq, (h + 1) dq) are head h's.
  const ParamSlice q_rows = shard.slice(0, heads * dqh_);
  if (ql_ > 0) {
    q_down_ = weight("linear_q_down_proj.weight", {ql_, H_}, cfg.init_std, {}, replicated);
    if (cfg.qk_layernorm) q_norm_ = norm("q_layernorm.weight", ql_);
    q_up_ = weight("linear_q_up_proj.weight", {heads * dqh_, ql_}, cfg.init_std, q_rows,
                   shard.sharded());
  } else {
    q_up_ = weight("linear_q_proj.weight", {heads * dqh_, H_}, cfg.init_std, q_rows,
                   shard.sharded());
  }
  kv_down_ = weight("linear_kv_down_proj.weight", {kl_ + pe_, H_}, cfg.init_std, {}, replicated);
  if (cfg.qk_layernorm) kv_norm_ = norm("kv_layernorm.weight", kl_);
  kv_up_ = weight("linear_kv_up_proj.weight", {heads * dkv, kl_}, cfg.init_std,
                  shard.slice(0, heads * dkv), shard.sharded());
  // Row-parallel: columns [h dv, (h + 1) dv) are head h's.
  proj_ = weight("linear_proj.weight", {H_, heads * dvh_}, cfg.output_init_std(),
                 shard.slice(1, heads * dvh_), shard.sharded());
  // Megatron's MLA gives --add-bias-linear's bias to linear_proj only (its down and up
  // projections have none; --add-qkv-bias is the QKV attention's): added by TP rank 0.
  if (cfg.add_attention_output_bias) {
    proj_bias_ = &params.add(ParamSpec{prefix + ".linear_proj.bias", {H_}, ParamInit::Zeros, 0.0,
                                       ParamKind::Dense, false, {}, false, shard.partial()});
  }
}

template <typename T>
void MlaAttention<T>::allocate(Arena& a, int64_t S, int64_t B) {
  ex_ = &a.exec();
  MOE_CHECK(S * core_.cp().size() <= rope_.max_pos || a.mode() == Arena::Mode::Plan,
            "[mla] sequence {} > the rotary tables' {} positions", S * core_.cp().size(),
            rope_.max_pos);
  MOE_CHECK(rope_.D == pe_ || a.mode() == Arena::Mode::Plan,
            "[mla] rotary tables of width {} for --qk-pos-emb-head-dim={}: build them from "
            "MlaConfig::rope_spec",
            rope_.D, pe_);
  shape_ = ops::AttentionShape{S, B, Hq_, Hq_, Dp_};
  shape_.bf16 = bf16_;
  if (prepare_core_ && core_.cp().size() == 1 && a.mode() != Arena::Mode::Plan)
    ops::attention_prepare(a.exec(), shape_, nullptr);
  const int64_t n = S * B, nl = tp_.local_tokens(n), dkv = qk_ + dvh_, lat = std::max(ql_, kl_);
  n_ = n;
  nl_ = nl;
  layout_ = ops::MlaLayoutShape{n, Hq_, qk_, pe_, dvh_};
  if (q_down_ != nullptr) saved_.q_c = a.alloc<T>(nl * ql_, "mla.q_c");
  if (q_norm_ != nullptr) {
    saved_.q_cn = a.alloc<T>(nl * ql_, "mla.q_cn");
    saved_.rstd_q = a.alloc<T>(nl, "mla.rstd_q");
  }
  saved_.kv_c = a.alloc<T>(nl * kl_, "mla.kv_c");
  if (kv_norm_ != nullptr) {
    saved_.kv_cn = a.alloc<T>(nl * kl_, "mla.kv_cn");
    saved_.rstd_kv = a.alloc<T>(nl, "mla.rstd_kv");
  }
  {
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, recompute_up_);
    saved_.q = a.alloc<T>(n * Hq_ * Dp_, "mla.q");
    saved_.k = a.alloc<T>(n * Hq_ * Dp_, "mla.k");
    saved_.v = a.alloc<T>(n * Hq_ * Dp_, "mla.v");
  }
  {
    Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, recompute_core_);
    saved_.core_out = a.alloc<T>(n * Hq_ * Dp_, "mla.core_out");
    saved_.lse = a.alloc<T>(B * Hq_ * S, "mla.lse");
  }
  pos_T_ = a.alloc<int32_t>(n, "mla.positions", MemKind::State);
  k_pe_raw_ = a.alloc<T>(nl * pe_, "mla.k_pe_raw", MemKind::Workspace);
  q_up_TC_ = a.alloc<T>(n * Hq_ * dqh_, "mla.q_up", MemKind::Workspace);
  q_pe_ = a.alloc<T>(n * Hq_ * pe_, "mla.q_pe", MemKind::Workspace);
  k_pe_ = a.alloc<T>(n * pe_, "mla.k_pe", MemKind::Workspace);
  kv_up_TC_ = a.alloc<T>(n * Hq_ * dkv, "mla.kv_up", MemKind::Workspace);
  dk_pe_raw_ = a.alloc<T>(nl * pe_, "mla.dk_pe_raw", MemKind::Workspace);
  dlat_ = a.alloc<T>(nl * lat, "mla.dlatent", MemKind::Workspace);
  dlat_n_ = a.alloc<T>(nl * lat, "mla.dlatent_normed", MemKind::Workspace);
  dq_ = a.alloc<T>(n * Hq_ * Dp_, "mla.dq", MemKind::Workspace);
  dk_ = a.alloc<T>(n * Hq_ * Dp_, "mla.dk", MemKind::Workspace);
  dv_ = a.alloc<T>(n * Hq_ * Dp_, "mla.dv", MemKind::Workspace);
  dcore_ = a.alloc<T>(n * Hq_ * Dp_, "mla.dcore", MemKind::Workspace);
  core_.allocate(a, shape_, "mla");
  if (tp_.sequence_parallel()) {
    if (q_down_ != nullptr)
      q_in_full_ = a.alloc<T>(n * ql_, "mla.q_latent_full", MemKind::Workspace);
    else
      x_full_ = a.alloc<T>(n * H_, "mla.x_full", MemKind::Workspace);
    kv_in_full_ = a.alloc<T>(n * kl_, "mla.kv_latent_full", MemKind::Workspace);
    k_pe_full_ = a.alloc<T>(n * pe_, "mla.k_pe_full", MemKind::Workspace);
    dlat_full_ = a.alloc<T>(n * lat, "mla.dlatent_full", MemKind::Workspace);
    y_full_ = a.alloc<T>(n * H_, "mla.y_full", MemKind::Workspace);
  }
  // Every projection; linear_proj over padded heads as column blocks of [T, Hq Dp].
  const int64_t q_in = q_down_ != nullptr ? ql_ : H_;
  lin_.allocate(a, *kv_down_,
                {{nl, ql_, H_}, {n, Hq_ * dqh_, q_in}, {nl, kl_ + pe_, H_}, {n, Hq_ * dkv, kl_},
                 {n, H_, Hq_ * (Dp_ == dvh_ ? dvh_ : Dp_)}},
                "mla");
  // --bf16 with SP: q's latent (x without q LoRA) and kv's feed only the up projections' bf16
  // GEMMs (their forward and weight gradients), which read their bf16 values: all-gathered as
  // bf16 through one staging buffer (TensorParallel::enter). The raw rotary key stays f32: RoPE
  // reads its f32 values. (After lin_.allocate: it decides whether the GEMMs are bf16.) Without
  // the output bias the backward's output gradient [n, H] travels through it too.
  lat_wire16_ = nullptr;
  if (tp_.sequence_parallel() && lin_.bf16()) {
    const int64_t width = std::max({q_in, kl_, proj_bias_ == nullptr ? H_ : int64_t{0}});
    lat_wire16_ = a.alloc<bf16>(tp_.enter_wire_elems(n, width), "mla.latent_wire16",
                                MemKind::Workspace);
  }
  x_rounded_ = false;  // until the block says otherwise
  if (pos_T_ != nullptr) core_.positions(pos_T_);
}

template <typename T>
void MlaAttention<T>::gather_latents(bool k_pe) {
  if (q_down_ != nullptr) {
    const DevPtr<const T> q_lat = q_norm_ != nullptr ? saved_.q_cn : saved_.q_c;
    q_in_ = tp_.enter(*ex_, q_lat, q_in_full_, n_, ql_, lat_wire16_);
  } else {
    q_in_ = tp_.enter(*ex_, saved_.x_TH, x_full_, n_, H_, lat_wire16_);
  }
  const DevPtr<const T> kv_lat = kv_norm_ != nullptr ? saved_.kv_cn : saved_.kv_c;
  kv_in_ = tp_.enter(*ex_, kv_lat, kv_in_full_, n_, kl_, lat_wire16_);
  if (k_pe) k_pe_in_ = tp_.enter(*ex_, DevPtr<const T>(k_pe_raw_), k_pe_full_, n_, pe_);
}

template <typename T>
void MlaAttention<T>::up_forward() {
  const int64_t n = n_, dkv = qk_ + dvh_;
  // Queries: [T, Hq, dq], the rotated part of each head into q_pe.
  if (q_down_ != nullptr)
    lin_.forward(q_up_TC_, q_in_, *q_up_, n, Hq_ * dqh_, ql_);
  else
    lin_.forward(q_up_TC_, q_in_, *q_up_, n, Hq_ * dqh_, H_, x_rounded_);
  ops::rope_mla_forward(*ex_, q_pe_, DevPtr<const T>(q_up_TC_ + qk_), pos_T_, n, Hq_, pe_, dqh_,
                        rope_);
  // Keys and values: [T, Hq, qk + dv], and the shared rotary key.
  lin_.forward(kv_up_TC_, kv_in_, *kv_up_, n, Hq_ * dkv, kl_);
  ops::rope_mla_forward(*ex_, k_pe_, k_pe_in_, pos_T_, n, 1, pe_, pe_, rope_);
  ops::mla_split(*ex_, saved_.q, saved_.k, saved_.v, DevPtr<const T>(q_up_TC_),
                 DevPtr<const T>(q_pe_), DevPtr<const T>(kv_up_TC_), DevPtr<const T>(k_pe_),
                 layout_, q_scale_);
}

template <typename T>
void MlaAttention<T>::proj_forward(DevPtr<T> y_TH, int64_t n) {
  if (Dp_ == dvh_) return lin_.forward(y_TH, saved_.core_out, *proj_, n, H_, Hq_ * dvh_);
  // Heads padded past dv: one GEMM per head over its first dv values, summed into y.
  lin_.forward_blocks(y_TH, saved_.core_out, *proj_, n, H_, Hq_, dvh_, Dp_);
}

template <typename T>
void MlaAttention<T>::proj_backward(DevPtr<const T> dy_TH, int64_t n) {
  if (Dp_ == dvh_) return lin_.backward(dcore_, dy_TH, saved_.core_out, *proj_, n, H_, Hq_ * dvh_);
  ops::zero(*ex_, dcore_, n * Hq_ * Dp_);  // the padding's gradient (out's padding is always 0)
  lin_.backward_blocks(dcore_, dy_TH, saved_.core_out, *proj_, n, H_, Hq_, dvh_, Dp_);
}

template <typename T>
void MlaAttention<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH) {
  const int64_t nl = nl_;
  saved_.x_TH = x_TH;
  // The latents of this rank's tokens.
  if (q_down_ != nullptr) {
    lin_.forward(saved_.q_c, x_TH, *q_down_, nl, ql_, H_, x_rounded_);
    if (q_norm_ != nullptr) {
      ops::rmsnorm_forward(*ex_, saved_.q_cn, saved_.rstd_q, saved_.q_c,
                           q_norm_->compute_as<T>(), nl, ql_, eps_);
    }
  }
  // linear_kv_down_proj's rows split into the latent [0, kl) and the shared rotary part
  // [kl, kl + pe) (two GEMMs on the weight's row blocks: no copy of the output).
  lin_.forward(saved_.kv_c, x_TH, *kv_down_, nl, kl_, H_, x_rounded_);
  lin_.forward(k_pe_raw_, x_TH, *kv_down_, nl, pe_, H_, x_rounded_, /*row0=*/kl_);
  if (kv_norm_ != nullptr) {
    ops::rmsnorm_forward(*ex_, saved_.kv_cn, saved_.rstd_kv, saved_.kv_c,
                         kv_norm_->compute_as<T>(), nl, kl_, eps_);
  }
  // Into the TP region: this rank's heads over every token.
  gather_latents(/*k_pe=*/true);
  up_forward();
  core_.forward(saved_.core_out, saved_.lse, saved_.q, saved_.k, saved_.v, drop_);
  // The row-parallel projection's partial sum: into y itself without SP (the all-reduce is in
  // place), else into the whole-token buffer that is reduce-scattered into y.
  const DevPtr<T> partial = tp_.sequence_parallel() ? y_full_ : y_TH;
  proj_forward(partial, n_);
  if (proj_bias_ != nullptr && tp_.rank() == 0)
    ops::bias_forward(*ex_, partial, proj_bias_->compute_as<T>(), n_, H_);
  tp_.leave(*ex_, partial, y_TH, n_, H_);
}

template <typename T>
void MlaAttention<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH) {
  const int64_t n = n_, nl = nl_, dkv = qk_ + dvh_;
  const bool sp = tp_.sequence_parallel();
  // The gathered latents again (their workspace was the other layers' meanwhile): the up
  // projections' weight gradients read them, and with mla_up_proj q, k and v are recomputed
  // from them; with core_attn the core's out and lse from q, k, v. The raw rotary key is not
  // kept: mla_up_proj recomputes it from the block input with its rows of linear_kv_down_proj
  // (pe of its kl + pe), so the recomputation keeps nothing the plain backward does not.
  if (recompute_up_)
    lin_.forward(k_pe_raw_, saved_.x_TH, *kv_down_, nl, pe_, H_, x_rounded_, /*row0=*/kl_);
  gather_latents(/*k_pe=*/recompute_up_);
  if (recompute_up_) up_forward();
  if (recompute_core_)
    core_.forward(saved_.core_out, saved_.lse, saved_.q, saved_.k, saved_.v, drop_);
  // --bf16 without the output bias: only the output projection's bf16 GEMMs read the gathered
  // gradient: as bf16, through the latents' staging buffer (their gathers are widened by now).
  const DevPtr<const T> dy = tp_.leave_backward(*ex_, dy_TH, y_full_, n, H_,
                                                proj_bias_ == nullptr ? lat_wire16_ : nullptr);
  if (proj_bias_ != nullptr && tp_.rank() == 0)
    ops::bias_backward(*ex_, proj_bias_->grad_as<T>(), dy, n, H_);
  proj_backward(dy, n);
  core_.backward(dq_, dk_, dv_, dcore_, saved_.q, saved_.k, saved_.v, saved_.core_out, saved_.lse,
                 drop_);
  // The projections' gradients into their forward buffers (free now): dq_up's first qk of each
  // head and dkv_up from the merge, dq_up's rotated part and dk_pe_raw from the rope backward.
  ops::mla_merge(*ex_, q_up_TC_, q_pe_, kv_up_TC_, k_pe_, DevPtr<const T>(dq_),
                 DevPtr<const T>(dk_), DevPtr<const T>(dv_), layout_, q_scale_);
  ops::rope_mla_backward(*ex_, q_up_TC_ + qk_, DevPtr<const T>(q_pe_), pos_T_, n, Hq_, dqh_, pe_,
                         rope_);
  // The raw rotary key's gradient over every token (this rank's heads' part), out of the region:
  // reduce-scattered into its first Tl rows with SP (from the gathered copy's buffer), summed in
  // place without.
  const DevPtr<T> dk_pe_full = sp ? k_pe_full_ : dk_pe_raw_;
  ops::rope_mla_backward(*ex_, dk_pe_full, DevPtr<const T>(k_pe_), pos_T_, n, 1, pe_, pe_, rope_);
  tp_.enter_backward(*ex_, dk_pe_full, dk_pe_raw_, n, pe_);
  // An up projection's input gradient (this rank's heads' part) out of the region into the
  // latent's gradient on this rank's tokens (dlat_n_ before a norm, dlat_ without one), then the
  // norm's backward into dlat_.
  auto latent_backward = [&](const Param& up, DevPtr<const T> dup, DevPtr<const T> in, int64_t N,
                             int64_t width, const Param* norm, DevPtr<const T> lat_raw,
                             DevPtr<const T> rstd) {
    const DevPtr<T> dlat = norm != nullptr ? dlat_n_ : dlat_;
    const DevPtr<T> dfull = sp ? dlat_full_ : dlat;
    lin_.backward(dfull, dup, in, up, n, N, width);
    tp_.enter_backward(*ex_, dfull, dlat, n, width);
    if (norm != nullptr) {
      ops::rmsnorm_backward(*ex_, dlat_, norm->grad_as<T>(), DevPtr<const T>(dlat_n_), lat_raw,
                            norm->compute_as<T>(), rstd, nl, width);
    }
  };
  // Queries back to the input: dx assigned.
  if (q_down_ != nullptr) {
    latent_backward(*q_up_, DevPtr<const T>(q_up_TC_), q_in_, Hq_ * dqh_, ql_, q_norm_,
                    DevPtr<const T>(saved_.q_c), DevPtr<const T>(saved_.rstd_q));
    lin_.backward(dx_TH, DevPtr<const T>(dlat_), saved_.x_TH, *q_down_, nl, ql_, H_, x_rounded_);
  } else {
    // linear_q_proj reads x over the whole region: its input gradient's partial sum into dx
    // without SP, else into the free output buffer, reduce-scattered into dx.
    const DevPtr<T> dx_full = sp ? y_full_ : dx_TH;
    lin_.backward(dx_full, DevPtr<const T>(q_up_TC_), q_in_, *q_up_, n, Hq_ * dqh_, H_,
                  x_rounded_);
    tp_.enter_backward(*ex_, dx_full, dx_TH, n, H_);
  }
  // Keys and values back to the input: added to dx.
  latent_backward(*kv_up_, DevPtr<const T>(kv_up_TC_), kv_in_, Hq_ * dkv, kl_, kv_norm_,
                  DevPtr<const T>(saved_.kv_c), DevPtr<const T>(saved_.rstd_kv));
  lin_.backward(dx_TH, DevPtr<const T>(dlat_), saved_.x_TH, *kv_down_, nl, kl_, H_, x_rounded_,
                /*accumulate_dx=*/true);
  lin_.backward(dx_TH, DevPtr<const T>(dk_pe_raw_), saved_.x_TH, *kv_down_, nl, pe_, H_,
                x_rounded_, /*accumulate_dx=*/true, /*row0=*/kl_);
}

template class MlaAttention<float>;
template class MlaAttention<double>;

}  // namespace moecore::model
