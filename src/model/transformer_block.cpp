#include "model/transformer_block.h"

#include <type_traits>

#include "core/check.h"
#include "core/rng.h"
#include "ops/add.h"
#include "ops/cast.h"
#include "ops/routing_table.h"

namespace moecore::model {

nn::NormConfig norm_config(const ModelConfig& cfg) {
  return nn::NormConfig{cfg.normalization == Normalization::LayerNorm, cfg.layernorm_1p,
                        cfg.norm_eps, cfg.hidden};
}

BlockSite BlockSite::decoder(const ModelConfig& cfg, int64_t layer) {
  return BlockSite{fmt::format("decoder.layers.{}", layer), layer, cfg.is_moe_layer(layer),
                   cfg.recompute.chunk_of(layer)};
}

BlockSite BlockSite::mtp(const ModelConfig& cfg, int64_t depth) {
  return BlockSite{fmt::format("mtp.layers.{}.transformer_layer", depth), cfg.num_layers + depth,
                   cfg.mtp_is_moe(), -1};
}

template <typename T>
TransformerBlock<T>::TransformerBlock(const ModelConfig& cfg, const BlockSite& site,
                                      ParamRegistry& params, const ops::RopeCache& rope,
                                      const parallel::ProcessGroups* groups, uint64_t seed,
                                      const ops::RopeMlaCache* mla_rope)
    : tp_(parallel::TensorParallel::attention(groups)),
      cp_(parallel::ContextParallel::attention(groups, site.member)),
      member_(site.member),
      H_(cfg.hidden),
      hidden_p_(cfg.hidden_dropout),
      key_attn_out_(rng_key(seed, site.prefix + ".self_attention.output_dropout")),
      key_ffn_out_(rng_key(seed, site.prefix + ".mlp.output_dropout")),
      recompute_chunk_(site.recompute_chunk),
      recompute_norms_(cfg.recompute.modules().layernorm),
      recompute_mlp_(cfg.recompute.modules().mlp),
      round_resid_(std::is_same_v<T, float> && cfg.bf16_residual()),
      norm1_(norm_config(cfg), params, site.prefix + ".input_layernorm", tp_.token_role()),
      norm2_(norm_config(cfg), params, site.prefix + ".pre_mlp_layernorm", tp_.token_role()) {
  const std::string attn_prefix = site.prefix + ".self_attention";
  if (cfg.multi_latent_attention) {
    MOE_CHECK(mla_rope != nullptr,
              "[block] {}: multi-latent attention needs its rotary tables (GPTModel builds "
              "them)",
              site.prefix);
    mla_ = std::make_unique<MlaAttention<T>>(cfg, params, attn_prefix, *mla_rope, tp_, cp_);
  } else {
    attn_ = std::make_unique<SelfAttention<T>>(cfg, params, attn_prefix, rope, tp_, cp_);
  }
  attn_drop_.p = cfg.attention_dropout;
  attn_drop_.key = rng_key(seed, site.prefix + ".self_attention.dropout");
  attn_drop_.head0 = attn_ != nullptr ? attn_->first_head() : mla_->first_head();
  const std::string mlp_prefix = site.prefix + ".mlp";
  if (site.moe) {
    // The MoE layer sees this CP rank's S/cp positions of each sequence (seq_aux_loss's
    // sequences; its counts are summed over TP x CP).
    MoeLayerConfig mc = cfg.moe_layer();
    mc.seq_length /= cp_.size();
    moe_ = std::make_unique<moe::MoELayer<T>>(mc, params, mlp_prefix, groups);
  } else {
    mlp_ = std::make_unique<nn::MLP<T>>(cfg.hidden, cfg.ffn_hidden, cfg.activation,
                                        cfg.add_mlp_bias, cfg.init_std, cfg.output_init_std(),
                                        params, mlp_prefix, tp_.shard());
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
  MOE_CHECK(!tp_.active() || S % tp_.size() == 0,
            "[block] sequence length {} is not divisible by the tensor-parallel size {}; choose "
            "a --seq-length that is a multiple of it",
            S, tp_.size());
  n_loc_ = tp_.local_tokens(n_tok_);
  S_loc_ = n_loc_ / B;
  s0_ = tp_.first_token(n_tok_) / B;
  // The MoE layer's tokens: this rank's sequence slice whenever tp > 1.
  const int64_t n_moe = tp_.with_sequence_parallel().local_tokens(n_tok_);
  // Workspace shares the layer's member of "layer". Recomputed activations go there too, or,
  // under full recomputation, to the chunk's member of "recompute" with every activation of the
  // layer (they are rebuilt together before the chunk's backward).
  const bool full = recompute_chunk_ >= 0;
  // The bf16 residual: n2 is Megatron-Core's bf16 hidden states entering the FFN (its pre-MLP
  // norm writes the stream's dtype; the router upcasts them for its f32 logits). Rounded once,
  // so the MoE layer's widened GEMMs read it as it is.
  const bool bf16_n2 = round_resid_;
  if (moe_ && bf16_n2) moe_->input_rounded();
  // The input's bf16 copy of a block that starts a recomputed chunk is what the chunk is
  // recomputed from: kept, outside the chunk's overlay.
  x16_ = keep_x16_ && input_kept_ ? a.alloc<bf16>(n_loc_ * H_, "block.input_bf16")
                                  : DevPtr<bf16>(nullptr);
  Arena::Share workspace(a, "layer", member_, {MemKind::Workspace});
  Arena::Share recomputed(a, full ? "recompute" : "layer", full ? recompute_chunk_ : member_,
                          {MemKind::Recomputed});
  Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, full);
  if (attn_ != nullptr)
    attn_->allocate(a, S, B);
  else
    mla_->allocate(a, S, B);
  if (moe_)
    moe_->allocate(a, n_moe);
  else
    mlp_->allocate(a, n_tok_, recompute_mlp_);  // the TP region's whole tokens
  // Widened bf16: a norm output that feeds only bf16 GEMMs is written as bf16 values, so the
  // GEMMs skip their rounding passes (n2 also feeds the router, in f32, in MoE layers).
  round_n1_ = attn_ != nullptr ? attn_->widened_bf16() : mla_->widened_bf16();
  if (round_n1_ && attn_ != nullptr) attn_->input_rounded();
  if (round_n1_ && mla_ != nullptr) mla_->input_rounded();
  round_n2_ = bf16_n2 || (mlp_ != nullptr && mlp_->widened_bf16());
  if (round_n2_ && mlp_ != nullptr) mlp_->input_rounded();
  // --bf16 (the attention's projections read bf16): n1 kept in bf16, read back in the backward.
  // With the layernorm recomputation the backward recomputes n1 into its f32 workspace and
  // never reads n1_16: planned as recomputed (the plan shrinks by the reported saving, the bf16
  // bytes a kept n1 would take) and left unwritten.
  // n2 the same under the bf16 residual (n2_16_, read back before the FFN's backward: the
  // router's weight gradient, the shared expert's or the dense MLP's, the "moe" recomputation);
  // its f32 form lives in dn_, free in the forward and until norm2's backward.
  const bool bf16_n1 = attn_ != nullptr ? attn_->stores_bf16() : mla_->reads_input_as_bf16();
  n1_16_ = nullptr;
  n2_16_ = nullptr;
  {
    Arena::Retag norms(a, MemKind::Activations, MemKind::Recomputed, recompute_norms_);
    if (bf16_n1) {
      n1_16_ = a.alloc<bf16>(n_loc_ * H_, "block.norm1_16");
      n1_ = a.alloc<T>(n_loc_ * H_, "block.norm1_32", MemKind::Workspace);
    } else {
      n1_ = a.alloc<T>(n_loc_ * H_, "block.norm1");
    }
    if (bf16_n2)
      n2_16_ = a.alloc<bf16>(n_loc_ * H_, "block.norm2_16");
    else
      n2_ = a.alloc<T>(n_loc_ * H_, "block.norm2");
  }
  norm1_.allocate(a, n_loc_, "block.rstd1");
  if (round_resid_) {
    // Megatron-Core's bf16 hidden states: x1 (norm2's input) and the input x (norm1's) are kept
    // as bf16 only; their f32 forms live in buffers the layer has anyway (forward(), backward()).
    x1_ = nullptr;
    x1_16_ = a.alloc<bf16>(n_loc_ * H_, "block.x1_bf16");
    if (keep_x16_ && !input_kept_) x16_ = a.alloc<bf16>(n_loc_ * H_, "block.input_bf16");
  } else {
    x1_ = a.alloc<T>(n_loc_ * H_, "block.x1");
  }
  norm2_.allocate(a, n_loc_, "block.rstd2");
  branch_ = a.alloc<T>(n_loc_ * H_, "block.branch", MemKind::Workspace);
  dn_ = a.alloc<T>(n_loc_ * H_, "block.dnorm", MemKind::Workspace);
  if (bf16_n2) n2_ = dn_;
  dx1_ = a.alloc<T>(n_loc_ * H_, "block.dx1", MemKind::Workspace);
  mlp_wire16_ = nullptr;
  if (mlp_ && tp_.sequence_parallel()) {
    full_x_ = a.alloc<T>(n_tok_ * H_, "block.mlp_in_full", MemKind::Workspace);
    full_y_ = a.alloc<T>(n_tok_ * H_, "block.mlp_out_full", MemKind::Workspace);
    // --bf16: n2 feeds only fc1's bf16 GEMMs here: gathered as bf16 (TensorParallel::enter);
    // without biases the output gradient too (mlp_backward()).
    if (mlp_->reads_input_as_bf16())
      mlp_wire16_ = a.alloc<bf16>(tp_.enter_wire_elems(n_tok_, H_), "block.mlp_in_wire16",
                                  MemKind::Workspace);
  }
  if (moe_ && tp_.active() && !tp_.sequence_parallel())
    moe_slice_ = a.alloc<T>(n_moe * H_, "block.moe_slice", MemKind::Workspace);
}

template <typename T>
void TransformerBlock<T>::moe_forward(DevPtr<const T> x, bool recompute) {
  replay_routing(/*after_forward=*/false);
  if (!tp_.active() || tp_.sequence_parallel()) {
    moe_->forward(branch_, x, n_loc_, recompute);
  } else {
    // Without SP: this rank's slice of the (replicated) stream, its output all-gathered over TP.
    const parallel::TensorParallel sp = tp_.with_sequence_parallel();
    const int64_t n = sp.local_tokens(n_tok_);
    moe_->forward(moe_slice_, x + sp.first_token(n_tok_) * H_, n, recompute);
    tp_.all_gather(*ex_, DevPtr<const T>(moe_slice_), branch_, n * H_);
  }
  replay_routing(/*after_forward=*/true);
}

template <typename T>
void TransformerBlock<T>::replay_routing(bool after_forward) {
  const RoutingReplayMode mode = moe_->routing_replay();
  const bool replay = mode == RoutingReplayMode::Replay && routing_table_ != nullptr && training_;
  if (!after_forward) moe_->router().set_routing_replayed(replay);
  const bool record = mode == RoutingReplayMode::Record && routing_table_ != nullptr && training_;
  if (after_forward ? !record : !replay) return;
  // The layer's tokens: this rank's sequence slice (S / TP rows of B tokens) of its CP positions.
  const parallel::TensorParallel sp = tp_.with_sequence_parallel();
  const int64_t first = sp.first_token(n_tok_) / B_, rows = sp.local_tokens(n_tok_) / B_;
  const int64_t S = S_ * cp_.size(), K = moe_->router().config().topk;
  moe::Router<T>& router = moe_->router();
  parallel::for_each_position_run(
      cp_.split(S), first, rows, [&](int64_t row, int64_t n, int64_t pos) {
        const int64_t at = (row - first) * B_ * K;
        if (record) {
          ops::routing_table_store(*ex_, routing_table_,
                                   DevPtr<const int32_t>(router.saved().routed_TK + at), B_, S, K,
                                   n, pos);
        } else {
          ops::routing_table_load(*ex_, router.replayed_experts() + at,
                                  DevPtr<const int32_t>(routing_table_), B_, S, K, n, pos);
        }
      });
}

template <typename T>
void TransformerBlock<T>::moe_backward(DevPtr<T> dx, DevPtr<const T> dy, double loss_grad_scale) {
  if (!tp_.active() || tp_.sequence_parallel()) return moe_->backward(dx, dy, loss_grad_scale);
  const parallel::TensorParallel sp = tp_.with_sequence_parallel();
  const int64_t n = sp.local_tokens(n_tok_);
  moe_->backward(moe_slice_, dy + sp.first_token(n_tok_) * H_, loss_grad_scale);
  tp_.all_gather(*ex_, DevPtr<const T>(moe_slice_), dx, n * H_);
}

template <typename T>
void TransformerBlock<T>::mlp_forward(DevPtr<T> y, DevPtr<const T> x) {
  const DevPtr<const T> xf = tp_.enter(*ex_, x, full_x_, n_tok_, H_, mlp_wire16_);
  const DevPtr<T> partial = tp_.sequence_parallel() ? full_y_ : y;
  mlp_->forward(partial, xf, n_tok_);
  tp_.leave(*ex_, partial, y, n_tok_, H_);
}

template <typename T>
void TransformerBlock<T>::mlp_backward(DevPtr<T> dx, DevPtr<const T> dy) {
  // The forward's gathered input again: the MLP's backward reads it (its workspace was the other
  // layers' meanwhile).
  tp_.enter(*ex_, DevPtr<const T>(n2_), full_x_, n_tok_, H_, mlp_wire16_);
  // --bf16 without biases only fc2's bf16 GEMMs read the gathered output gradient: as bf16.
  const DevPtr<const T> dyf = tp_.leave_backward(
      *ex_, dy, full_y_, n_tok_, H_, mlp_->reads_output_grad_as_bf16() ? mlp_wire16_ : nullptr);
  // The input gradient's partial sum: into dx without SP, else into the gathered output
  // gradient's buffer (the MLP's backward reads dy before it writes dx; it reads x after).
  const DevPtr<T> dxf = tp_.sequence_parallel() ? full_y_ : dx;
  mlp_->backward(dxf, dyf);
  tp_.enter_backward(*ex_, dxf, dx, n_tok_, H_);
}

template <typename T>
void TransformerBlock<T>::residual_add(DevPtr<T> y, DevPtr<const T> residual,
                                       DevPtr<const T> branch, uint64_t key) {
  if (!dropping()) return ops::add(*ex_, y, residual, branch, n_loc_ * H_);
  for_each_dropout_run([&](int64_t row, int64_t rows, int64_t pos) {
    const int64_t off = (row - s0_) * B_ * H_;
    ops::dropout_add_forward(*ex_, y + off, residual + off, branch + off, hidden_p_, key,
                             counters_, rows, B_, H_, pos);
  });
}

template <typename T>
void TransformerBlock<T>::round_stream(DevPtr<T> y) {
  if constexpr (std::is_same_v<T, float>) {
    if (round_resid_) ops::round_f32_to_bf16(*ex_, y, DevPtr<const float>(y), n_loc_ * H_);
  }
}

template <typename T>
void TransformerBlock<T>::restore_input() {
  if (keep_x16_) widen_kept(x_scratch_, x16_);
}

template <typename T>
void TransformerBlock<T>::widen_kept(DevPtr<T> y, DevPtr<const bf16> x16) {
  if constexpr (std::is_same_v<T, float>) {
    ops::cast_bf16_to_f32(*ex_, y, x16, n_loc_ * H_);
  } else {
    MOE_CHECK(false, "[block] bf16 residual copies exist only in f32 models");
  }
}

template <typename T>
template <typename F>
void TransformerBlock<T>::for_each_dropout_run(F&& f) const {
  parallel::for_each_position_run(cp_.split(S_ * cp_.size()), s0_, S_loc_, f);
}

template <typename T>
void TransformerBlock<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, bool recompute) {
  x_TH_ = x_TH;
  if constexpr (std::is_same_v<T, float>) {
    // The input's bf16 values (its producer rounded them): the cast is exact.
    if (keep_x16_) ops::cast_f32_to_bf16(*ex_, x16_, x_TH, n_loc_ * H_);
  }
  const ops::AttentionDropout* drop = training_ && attn_drop_.p > 0 ? &attn_drop_ : nullptr;
  if (attn_ != nullptr)
    attn_->set_dropout(drop);
  else
    mla_->set_dropout(drop);
  attn_drop_.counters = counters_;
  norm1_.forward(*ex_, n1_, x_TH, n_loc_, round_n1_);
  store_n1();
  if (attn_ != nullptr)
    attn_->forward(branch_, n1_);
  else
    mla_->forward(branch_, n1_);
  // bf16 residual: x1's f32 form in y (the second add reads it and overwrites it in place), its
  // bf16 copy kept.
  const DevPtr<T> x1 = round_resid_ ? y_TH : x1_;
  residual_add(x1, x_TH, branch_, key_attn_out_);
  round_stream(x1);
  if constexpr (std::is_same_v<T, float>) {
    if (round_resid_) ops::cast_f32_to_bf16(*ex_, x1_16_, DevPtr<const float>(x1), n_loc_ * H_);
  }
  norm2_.forward(*ex_, n2_, x1, n_loc_, round_n2_);
  store_n2();
  if (moe_)
    moe_forward(n2_, recompute);
  else
    mlp_forward(branch_, n2_);
  residual_add(y_TH, x1, branch_, key_ffn_out_);
  round_stream(y_TH);
}

template <typename T>
void TransformerBlock<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, double loss_grad_scale) {
  const int64_t n = n_loc_ * H_;
  // bf16 residual: x1's f32 form again (exactly the values the forward's norm2 read) in dx1_,
  // where it is needed: before the FFN's backward for the recomputed n2, after it for norm2's
  // backward (the dropout's gradient takes dx1_ in between).
  const DevPtr<const T> x1 = round_resid_ ? DevPtr<const T>(dx1_) : DevPtr<const T>(x1_);
  // "layernorm" recomputation: the FFN reads its input n2 in its backward. Else, n2 kept in
  // bf16: widened into its f32 workspace.
  if (recompute_norms_) {
    if (round_resid_) widen_kept(dx1_, x1_16_);
    norm2_.forward(*ex_, n2_, x1, n_loc_, round_n2_);
  }
  load_n2();
  // FFN branch: dx1 = dy + norm2'(ffn'(dropout'(dy))).
  DevPtr<const T> dffn = dy_TH;
  if (dropping()) {
    for_each_dropout_run([&](int64_t row, int64_t rows, int64_t pos) {
      const int64_t off = (row - s0_) * B_ * H_;
      ops::dropout_backward(*ex_, dx1_ + off, dy_TH + off, hidden_p_, key_ffn_out_, counters_,
                            rows, B_, H_, pos);
    });
    dffn = dx1_;
  }
  // The FFN's input gradient into branch_: dn_ may hold n2, which the FFN's backward reads.
  if (moe_)
    moe_backward(branch_, dffn, loss_grad_scale);
  else
    mlp_backward(branch_, dffn);
  if (round_resid_) widen_kept(dx1_, x1_16_);
  norm2_.backward(*ex_, dn_, branch_, x1, n_loc_);
  ops::add(*ex_, dx1_, dy_TH, dn_, n);
  // Attention branch: dx = dx1 + norm1'(attn'(dropout'(dx1))).
  // The input kept as bf16: widened into the owner's input buffer, left to this backward.
  DevPtr<const T> x_in = x_TH_;
  if (keep_x16_) {
    widen_kept(x_scratch_, x16_);
    x_in = x_scratch_;
  }
  if (recompute_norms_) norm1_.forward(*ex_, n1_, x_in, n_loc_, round_n1_);
  load_n1();
  DevPtr<const T> dattn = dx1_;
  if (dropping()) {
    for_each_dropout_run([&](int64_t row, int64_t rows, int64_t pos) {
      const int64_t off = (row - s0_) * B_ * H_;
      ops::dropout_backward(*ex_, branch_ + off, DevPtr<const T>(dx1_ + off), hidden_p_,
                            key_attn_out_, counters_, rows, B_, H_, pos);
    });
    dattn = branch_;
  }
  if (attn_ != nullptr)
    attn_->backward(dn_, dattn);
  else
    mla_->backward(dn_, dattn);
  norm1_.backward(*ex_, branch_, dn_, x_in, n_loc_);
  ops::add(*ex_, dx_TH, dx1_, branch_, n);
}

template <typename T>
void TransformerBlock<T>::store_n1() {
  // The bf16 value of each element: the one the input GEMMs read (they cast or round their input
  // to bf16 on both paths), so keeping n1 in bf16 leaves the numerics bitwise as they were.
  // Two passes (the norm, a cast); a norm writing bf16 directly would be one.
  if constexpr (std::is_same_v<T, float>) {
    if (n1_16_ != nullptr && !recompute_norms_)
      ops::cast_f32_to_bf16(*ex_, n1_16_, DevPtr<const float>(n1_), n_loc_ * H_);
  }
}

template <typename T>
void TransformerBlock<T>::load_n1() {
  // n1's workspace was the other layers' meanwhile; the attention's backward reads it (its
  // weight gradients' input). Widened: the bf16 values the GEMMs read in the forward.
  if constexpr (std::is_same_v<T, float>) {
    if (n1_16_ != nullptr && !recompute_norms_)
      ops::cast_bf16_to_f32(*ex_, n1_, DevPtr<const bf16>(n1_16_), n_loc_ * H_);
  }
}

template <typename T>
void TransformerBlock<T>::store_n2() {
  // Exact: n2 holds bf16 values (rounded by the norm).
  if constexpr (std::is_same_v<T, float>) {
    if (n2_16_ != nullptr && !recompute_norms_)
      ops::cast_f32_to_bf16(*ex_, n2_16_, DevPtr<const float>(n2_), n_loc_ * H_);
  }
}

template <typename T>
void TransformerBlock<T>::load_n2() {
  // n2's workspace was the other layers' meanwhile (and this backward's dn_ before it).
  if (n2_16_ != nullptr && !recompute_norms_) widen_kept(n2_, n2_16_);
}

template class TransformerBlock<float>;
template class TransformerBlock<double>;

}  // namespace moecore::model
