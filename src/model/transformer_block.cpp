#include "model/transformer_block.h"

#include <type_traits>

#include "core/rng.h"
#include "ops/add.h"

namespace moecore::model {

namespace {
nn::NormConfig norm_config(const ModelConfig& cfg) {
  return nn::NormConfig{cfg.normalization == Normalization::LayerNorm, cfg.layernorm_1p,
                        cfg.norm_eps, cfg.hidden};
}
}  // namespace

template <typename T>
TransformerBlock<T>::TransformerBlock(const ModelConfig& cfg, int64_t layer, ParamRegistry& params,
                                      const ops::RopeCache& rope,
                                      const parallel::ProcessGroups* groups, uint64_t seed)
    : layer_(layer),
      H_(cfg.hidden),
      hidden_p_(cfg.hidden_dropout),
      key_attn_out_(rng_key(seed, fmt::format("decoder.layers.{}.self_attention.output_dropout",
                                              layer))),
      key_ffn_out_(rng_key(seed, fmt::format("decoder.layers.{}.mlp.output_dropout", layer))),
      recompute_chunk_(cfg.recompute.chunk_of(layer)),
      recompute_norms_(cfg.recompute.modules().layernorm),
      recompute_mlp_(cfg.recompute.modules().mlp),
      norm1_(norm_config(cfg), params, fmt::format("decoder.layers.{}.input_layernorm", layer)),
      norm2_(norm_config(cfg), params, fmt::format("decoder.layers.{}.pre_mlp_layernorm", layer)),
      attn_(cfg, params, fmt::format("decoder.layers.{}.self_attention", layer), rope) {
  attn_drop_.p = cfg.attention_dropout;
  attn_drop_.key = rng_key(seed, fmt::format("decoder.layers.{}.self_attention.dropout", layer));
  std::string mlp_prefix = fmt::format("decoder.layers.{}.mlp", layer);
  if (cfg.is_moe_layer(layer)) {
    moe_ = std::make_unique<moe::MoELayer<T>>(cfg.moe_layer(), params, mlp_prefix, groups);
  } else {
    mlp_ = std::make_unique<nn::MLP<T>>(cfg.hidden, cfg.ffn_hidden, cfg.activation,
                                        cfg.add_mlp_bias, cfg.init_std, cfg.output_init_std(),
                                        params, mlp_prefix);
  }
}

template <typename T>
void TransformerBlock<T>::set_training(bool training) {
  training_ = training;
  if (moe_) moe_->set_training(training);
}

template <typename T>
void TransformerBlock<T>::allocate(Arena& a, int64_t S, int64_t B) {
  ex_ = &a.exec();
  S_ = S;
  B_ = B;
  n_tok_ = S * B;
  // Workspace shares the layer's member of "layer". Recomputed activations go there too, or,
  // under full recomputation, to the chunk's member of "recompute" with every activation of the
  // layer (they are rebuilt together before the chunk's backward).
  const bool full = recompute_chunk_ >= 0;
  Arena::Share workspace(a, "layer", layer_, {MemKind::Workspace});
  Arena::Share recomputed(a, full ? "recompute" : "layer", full ? recompute_chunk_ : layer_,
                          {MemKind::Recomputed});
  Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, full);
  attn_.allocate(a, S, B);
  if (moe_)
    moe_->allocate(a, n_tok_);
  else
    mlp_->allocate(a, n_tok_, recompute_mlp_);
  // Widened bf16: a norm output that feeds only bf16 GEMMs is written as bf16 values, so the
  // GEMMs skip their rounding passes (n2 also feeds the router, in f32, in MoE layers).
  round_n1_ = attn_.widened_bf16();
  if (round_n1_) attn_.input_rounded();
  round_n2_ = mlp_ != nullptr && mlp_->widened_bf16();
  if (round_n2_) mlp_->input_rounded();
  {
    Arena::Retag norms(a, MemKind::Activations, MemKind::Recomputed, recompute_norms_);
    n1_ = a.alloc<T>(n_tok_ * H_, "block.norm1");
    n2_ = a.alloc<T>(n_tok_ * H_, "block.norm2");
  }
  norm1_.allocate(a, n_tok_, "block.rstd1");
  x1_ = a.alloc<T>(n_tok_ * H_, "block.x1");
  norm2_.allocate(a, n_tok_, "block.rstd2");
  branch_ = a.alloc<T>(n_tok_ * H_, "block.branch", MemKind::Workspace);
  dn_ = a.alloc<T>(n_tok_ * H_, "block.dnorm", MemKind::Workspace);
  dx1_ = a.alloc<T>(n_tok_ * H_, "block.dx1", MemKind::Workspace);
}

template <typename T>
void TransformerBlock<T>::residual_add(DevPtr<T> y, DevPtr<const T> residual,
                                       DevPtr<const T> branch, uint64_t key) {
  if (!dropping()) return ops::add(*ex_, y, residual, branch, n_tok_ * H_);
  ops::dropout_add_forward(*ex_, y, residual, branch, hidden_p_, key, counters_, S_, B_, H_, 0);
}

template <typename T>
void TransformerBlock<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, bool recompute) {
  x_TH_ = x_TH;
  attn_.set_dropout(training_ && attn_drop_.p > 0 ? &attn_drop_ : nullptr);
  attn_drop_.counters = counters_;
  norm1_.forward(*ex_, n1_, x_TH, n_tok_, round_n1_);
  attn_.forward(branch_, n1_);
  residual_add(x1_, x_TH, branch_, key_attn_out_);
  norm2_.forward(*ex_, n2_, x1_, n_tok_, round_n2_);
  if (moe_)
    moe_->forward(branch_, n2_, n_tok_, recompute);
  else
    mlp_->forward(branch_, n2_, n_tok_);
  residual_add(y_TH, x1_, branch_, key_ffn_out_);
}

template <typename T>
void TransformerBlock<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, double loss_grad_scale) {
  const int64_t n = n_tok_ * H_;
  // "layernorm" recomputation: the FFN reads its input n2 in its backward.
  if (recompute_norms_) norm2_.forward(*ex_, n2_, x1_, n_tok_, round_n2_);
  // FFN branch: dx1 = dy + norm2'(ffn'(dropout'(dy))).
  DevPtr<const T> dffn = dy_TH;
  if (dropping()) {
    ops::dropout_backward(*ex_, dx1_, dy_TH, hidden_p_, key_ffn_out_, counters_, S_, B_, H_, 0);
    dffn = dx1_;
  }
  if (moe_)
    moe_->backward(dn_, dffn, loss_grad_scale);
  else
    mlp_->backward(dn_, dffn);
  norm2_.backward(*ex_, branch_, dn_, x1_, n_tok_);
  ops::add(*ex_, dx1_, dy_TH, branch_, n);
  // Attention branch: dx = dx1 + norm1'(attn'(dropout'(dx1))).
  if (recompute_norms_) norm1_.forward(*ex_, n1_, x_TH_, n_tok_, round_n1_);
  DevPtr<const T> dattn = dx1_;
  if (dropping()) {
    ops::dropout_backward(*ex_, branch_, DevPtr<const T>(dx1_), hidden_p_, key_attn_out_,
                          counters_, S_, B_, H_, 0);
    dattn = branch_;
  }
  attn_.backward(dn_, dattn);
  norm1_.backward(*ex_, branch_, dn_, x_TH_, n_tok_);
  ops::add(*ex_, dx_TH, dx1_, branch_, n);
}

template class TransformerBlock<float>;
template class TransformerBlock<double>;

}  // namespace moecore::model
