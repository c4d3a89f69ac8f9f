#include "model/transformer_block.h"

#include <type_traits>

#include "ops/add.h"
#include "ops/rmsnorm.h"

namespace moecore::model {

template <typename T>
TransformerBlock<T>::TransformerBlock(const ModelConfig& cfg, int64_t layer, ParamRegistry& params,
                                      const ops::RopeCache& rope,
                                      const parallel::ProcessGroups* groups)
    : layer_(layer),
      H_(cfg.hidden),
      eps_(cfg.norm_eps),
      recompute_chunk_(cfg.recompute.chunk_of(layer)),
      recompute_norms_(cfg.recompute.modules().layernorm),
      recompute_mlp_(cfg.recompute.modules().mlp),
      norm1_(&params.add(ParamSpec{fmt::format("decoder.layers.{}.input_layernorm.weight", layer),
                                   {cfg.hidden},
                                   ParamInit::Ones,
                                   0.0,
                                   ParamKind::Dense,
                                   false,
                                   {}})),
      norm2_(&params.add(ParamSpec{fmt::format("decoder.layers.{}.pre_mlp_layernorm.weight", layer),
                                   {cfg.hidden},
                                   ParamInit::Ones,
                                   0.0,
                                   ParamKind::Dense,
                                   false,
                                   {}})),
      attn_(cfg, params, fmt::format("decoder.layers.{}.self_attention", layer), rope) {
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
void TransformerBlock<T>::allocate(Arena& a, int64_t S, int64_t B) {
  ex_ = &a.exec();
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
  rstd1_ = a.alloc<T>(n_tok_, "block.rstd1");
  x1_ = a.alloc<T>(n_tok_ * H_, "block.x1");
  rstd2_ = a.alloc<T>(n_tok_, "block.rstd2");
  branch_ = a.alloc<T>(n_tok_ * H_, "block.branch", MemKind::Workspace);
  dn_ = a.alloc<T>(n_tok_ * H_, "block.dnorm", MemKind::Workspace);
  dx1_ = a.alloc<T>(n_tok_ * H_, "block.dx1", MemKind::Workspace);
}

template <typename T>
void TransformerBlock<T>::norm(DevPtr<T> y, DevPtr<T> rstd, DevPtr<const T> x, const Param& w,
                               bool round) {
  if constexpr (std::is_same_v<T, float>) {
    if (round)
      return ops::rmsnorm_forward_bf16w(*ex_, y, rstd, x, w.data_as<T>(), n_tok_, H_, eps_);
  }
  ops::rmsnorm_forward(*ex_, y, rstd, x, w.data_as<T>(), n_tok_, H_, eps_);
}

template <typename T>
void TransformerBlock<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, bool recompute) {
  const int64_t n = n_tok_ * H_;
  x_TH_ = x_TH;
  norm(n1_, rstd1_, x_TH, *norm1_, round_n1_);
  attn_.forward(branch_, n1_);
  ops::add(*ex_, x1_, x_TH, branch_, n);
  norm(n2_, rstd2_, x1_, *norm2_, round_n2_);
  if (moe_)
    moe_->forward(branch_, n2_, n_tok_, recompute);
  else
    mlp_->forward(branch_, n2_, n_tok_);
  ops::add(*ex_, y_TH, x1_, branch_, n);
}

template <typename T>
void TransformerBlock<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, double loss_grad_scale) {
  const int64_t n = n_tok_ * H_;
  // "layernorm" recomputation: the FFN reads its input n2 in its backward.
  if (recompute_norms_) {
    norm(n2_, rstd2_, x1_, *norm2_, round_n2_);
  }
  // FFN branch: dx1 = dy + norm2'(ffn'(dy)).
  if (moe_)
    moe_->backward(dn_, dy_TH, loss_grad_scale);
  else
    mlp_->backward(dn_, dy_TH);
  ops::rmsnorm_backward(*ex_, branch_, norm2_->grad_as<T>(), dn_, x1_, norm2_->data_as<T>(), rstd2_,
                        n_tok_, H_);
  ops::add(*ex_, dx1_, dy_TH, branch_, n);
  // Attention branch: dx = dx1 + norm1'(attn'(dx1)).
  if (recompute_norms_) {
    norm(n1_, rstd1_, x_TH_, *norm1_, round_n1_);
  }
  attn_.backward(dn_, dx1_);
  ops::rmsnorm_backward(*ex_, branch_, norm1_->grad_as<T>(), dn_, x_TH_, norm1_->data_as<T>(),
                        rstd1_, n_tok_, H_);
  ops::add(*ex_, dx_TH, dx1_, branch_, n);
}

template class TransformerBlock<float>;
template class TransformerBlock<double>;

}  // namespace moecore::model
