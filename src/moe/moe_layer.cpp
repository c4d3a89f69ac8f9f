#include "moe/moe_layer.h"

#include <type_traits>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/cast.h"
#include "parallel/process_groups.h"
#include "parallel/tensor_parallel.h"

namespace moecore::moe {

template <typename T>
MoELayer<T>::MoELayer(const MoeLayerConfig& cfg, ParamRegistry& params, const std::string& prefix,
                      const parallel::ProcessGroups* groups)
    : MoELayer(cfg, params, prefix, make_dispatcher<T>(cfg, groups), groups) {}

template <typename T>
MoELayer<T>::MoELayer(const MoeLayerConfig& cfg, ParamRegistry& params, const std::string& prefix,
                      std::unique_ptr<TokenDispatcher<T>> dispatcher,
                      const parallel::ProcessGroups* groups)
    : prefix_(prefix),
      routing_replay_(cfg.moe.routing_replay),
      H_(cfg.hidden),
      K_(cfg.moe.router.topk),
      seq_length_(cfg.seq_length / parallel::TensorParallel::attention(groups).size()),
      pad_to_capacity_(cfg.moe.router.pad_to_capacity),
      recompute_(cfg.recompute),
      router_(cfg.moe.router, cfg.hidden, cfg.init_std, params, prefix,
              parallel::TensorParallel::attention(groups).shard().partial()),
      dispatcher_(dispatcher ? std::move(dispatcher) : make_dispatcher<T>(cfg, nullptr)),
      experts_(cfg.num_experts, dispatcher_->first_local_expert(), dispatcher_->num_local_experts(),
               nn::MlpShape{cfg.hidden, cfg.moe.ffn_hidden, cfg.activation, cfg.add_mlp_bias},
               cfg.init_std, cfg.output_init_std, params, prefix,
               parallel::TensorParallel::expert(groups).shard()) {
  cfg.moe.validate();
  const int tp = parallel::TensorParallel::attention(groups).size();
  MOE_CHECK(cfg.seq_length % tp == 0,
            "[moe] --seq-length {} is not divisible by --tensor-model-parallel-size {}: the MoE "
            "layer holds S/TP positions of every sequence; pick a sequence length divisible by {}",
            cfg.seq_length, tp, tp);
  MOE_CHECK(tp == 1 || !cfg.moe.router.uses(LoadBalancing::QuantileBalancing),
            "[moe] quantile_balancing with --tensor-model-parallel-size {} is not implemented "
            "yet (its quantile estimate needs the TP x CP group's logits): use TP 1 or another "
            "--moe-router-load-balancing-type",
            tp);
  if (groups != nullptr && groups->group(parallel::GroupKind::TpCp).size() > 1) {
    router_.set_token_group(&groups->group(parallel::GroupKind::TpCp).device_communicator());
  }
  if (cfg.moe.routing_replay == RoutingReplayMode::Replay) router_.enable_routing_replay();
  if (cfg.moe.shared_ffn_hidden > 0) {
    shared_ = std::make_unique<SharedExperts<T>>(cfg, params, prefix, groups);
  }
  overlap_shared_ = shared_ != nullptr && cfg.moe.shared_expert_overlap;
}

template <typename T>
void MoELayer<T>::allocate(Arena& a, int64_t max_tokens) {
  ex_ = &a.exec();
  Arena::Retag retag(a, MemKind::Activations, MemKind::Recomputed, recompute_.moe);
  router_.allocate(a, max_tokens);
  dispatcher_->allocate(a, max_tokens);
  const int64_t rows = dispatcher_->max_rows(max_tokens);
  experts_.allocate(a, rows, nn::MlpRecompute{recompute_.moe, recompute_.moe_act});
  // --bf16: the input feeds the router in f32 and, as bf16, the experts' fc1 GEMMs: it is cast
  // once into x16_TH_ (consumed by the dispatch's start) and the dispatch moves bf16 rows
  // (rows16_). The same for the output's gradient, which feeds only the fc2 GEMMs (dy16_; not
  // with biases, whose gradients sum dy's f32 values).
  rows16_ = std::is_same_v<T, float> && bf16_dispatch_ && experts_.reads_bf16_rows();
  dy16_ = rows16_ && !experts_.has_bias();
  // Widened bf16: the shared expert's fc1 GEMM (and, with f32 rows, the experts') reads the
  // input's bf16 values, rounded once into x16w_TH_ (rounding commutes with the permutation)
  // instead of at each GEMM; the output's gradient the same, dy16w_TH_.
  const bool widened = experts_.widened_bf16();
  round_rows_ = widened && !input_rounded_ && (!rows16_ || shared_ != nullptr);
  if (input_rounded_ && !rows16_) experts_.input_rounded();  // a no-op on the native path
  round_dy_ = widened && !experts_.has_bias() && (!dy16_ || shared_ != nullptr);
  if (round_rows_) {
    if (!rows16_) experts_.input_rounded();
    x16w_TH_ = a.alloc<T>(max_tokens * H_, "moe.x_bf16_values");
  }
  if (round_dy_) {
    if (!dy16_) experts_.output_grad_rounded();
    dy16w_TH_ = a.alloc<T>(max_tokens * H_, "moe.dy_bf16_values", MemKind::Workspace);
  }
  if (rows16_) {
    x16_TH_ = a.alloc<bf16>(max_tokens * H_, "moe.x_bf16", MemKind::Workspace);
    x16_NH_ = a.alloc<bf16>(rows * H_, "moe.x_rows");
  } else {
    x_NH_ = a.alloc<T>(rows * H_, "moe.x_rows");
  }
  p_N_ = a.alloc<T>(rows, "moe.p_rows");
  y_NH_ = a.alloc<T>(rows * H_, "moe.y_rows", MemKind::Workspace);
  // One bf16 buffer for the way back of both passes: the combine has finished with it before
  // the backward starts.
  if (rows16_) back16_NH_ = a.alloc<bf16>(rows * H_, "moe.back_rows_bf16", MemKind::Workspace);
  if (dy16_) {
    dy16_TH_ = a.alloc<bf16>(max_tokens * H_, "moe.dy_bf16", MemKind::Workspace);
    dy16_NH_ = a.alloc<bf16>(rows * H_, "moe.dy_rows", MemKind::Workspace);
  } else {
    dy_NH_ = a.alloc<T>(rows * H_, "moe.dy_rows", MemKind::Workspace);
  }
  dx_NH_ = a.alloc<T>(rows * H_, "moe.dx_rows", MemKind::Workspace);
  dp_N_ = a.alloc<T>(rows, "moe.dp_rows", MemKind::Workspace);
  dprobs_TK_ = a.alloc<T>(max_tokens * K_, "moe.dprobs", MemKind::Workspace);
  if (shared_)
    shared_->allocate(a, max_tokens, recompute_, round_rows_ || input_rounded_, round_dy_);
}

template <typename T>
void MoELayer<T>::shared_forward_in_flight() {
  shared_overlaps_.dispatch += dispatcher_->in_flight();
  shared_->compute_fc1(x_TH_, gemm_input(x_TH_), n_tok_);
}

template <typename T>
void MoELayer<T>::route_and_dispatch(DevPtr<const T> x_TH, int64_t n_tok, bool recompute,
                                     bool shared_in_flight) {
  n_tok_ = n_tok;
  x_TH_ = x_TH;
  // Whole sequences only matter to seq_aux_loss; a partial one (layer tests) counts as one.
  {
    ScopedPhase phase(Phase::Router);
    router_.forward(x_TH, n_tok, n_tok % seq_length_ == 0 ? seq_length_ : 0, recompute);
  }
  const auto& rs = router_.saved();
  {
    ScopedPhase phase(Phase::Permute);
    plan_ = &dispatcher_->plan(rs.idx_TK, n_tok, pad_to_capacity_ ? rs.capacity : 0);
  }
  if constexpr (std::is_same_v<T, float>) {
    ScopedPhase phase(Phase::Gemm);  // where the GEMMs' own rounding was counted
    if (round_rows_) ops::round_f32_to_bf16(*ex_, x16w_TH_, x_TH, n_tok * H_);
    if (rows16_) ops::cast_f32_to_bf16(*ex_, x16_TH_, x_TH, n_tok * H_);
  }
  {
    ScopedPhase phase(Phase::Permute);
    if (rows16_) {
      dispatcher_->dispatch16_start(x16_NH_, p_N_, x16_TH_, rs.probs_TK);
    } else {
      dispatcher_->dispatch_start(x_NH_, p_N_, gemm_input(x_TH), rs.probs_TK);
    }
  }
  // --moe-shared-expert-overlap: the shared expert reads only the layer's input, so its first
  // half (to the activation) runs while the dispatch's all-to-all is in flight.
  if (shared_in_flight) shared_forward_in_flight();
  {
    ScopedPhase phase(Phase::Permute);
    dispatcher_->dispatch_finish();
  }
}

template <typename T>
void MoELayer<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, int64_t n_tok, bool recompute) {
  route_and_dispatch(x_TH, n_tok, recompute, overlap_shared_);
  // Padded dispatch: every local expert's rows are known on the host (no size read on CUDA).
  if (rows16_) {
    experts_.forward(y_NH_, x16_NH_, p_N_, plan_->tokens_per_expert_L, plan_->n_rows,
                     plan_->rows_per_expert);
  } else {
    experts_.forward(y_NH_, x_NH_, p_N_, plan_->tokens_per_expert_L, plan_->n_rows,
                     plan_->rows_per_expert);
  }
  {
    ScopedPhase phase(Phase::Permute);
    if (rows16_) {
      dispatcher_->combine16_start(y_TH, y_NH_, back16_NH_);
    } else {
      dispatcher_->combine_start(y_TH, y_NH_);
    }
  }
  // Its second half (fc2) while the combine's all-to-all is in flight; the output waits in its
  // own buffer until the combine has assigned y.
  if (overlap_shared_) {
    shared_overlaps_.combine += dispatcher_->in_flight();
    shared_->compute_fc2();
  }
  {
    ScopedPhase phase(Phase::Permute);
    dispatcher_->combine_finish();
  }
  if (!shared_) return;
  // y = the routed experts' combine, then + the shared output: the same order with the overlap.
  if (!overlap_shared_) shared_->compute(x_TH, gemm_input(x_TH), n_tok);
  shared_->add_output(y_TH);
}

template <typename T>
void MoELayer<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, double loss_grad_scale) {
  // "moe" recomputation: routing and the expert rows again (the experts recompute their fc1).
  if (recompute_.moe) route_and_dispatch(x_TH_, n_tok_, /*recompute=*/true, false);
  DevPtr<const T> dy_in = dy_TH;  // what the experts' and the shared expert's GEMMs read
  if constexpr (std::is_same_v<T, float>) {
    ScopedPhase phase(Phase::Gemm);
    if (round_dy_) {
      ops::round_f32_to_bf16(*ex_, dy16w_TH_, dy_TH, n_tok_ * H_);
      dy_in = dy16w_TH_;
    }
    if (dy16_) ops::cast_f32_to_bf16(*ex_, dy16_TH_, dy_TH, n_tok_ * H_);
  }
  {
    ScopedPhase phase(Phase::Permute);
    if (dy16_) {
      dispatcher_->combine_backward16_start(dy16_NH_, dy16_TH_);
    } else {
      dispatcher_->combine_backward_start(dy_NH_, dy_in);
    }
  }
  // --moe-shared-expert-overlap: the shared expert's backward reads only dy (and what its
  // forward kept): its first half (fc2's and the activation's) runs while dy's all-to-all to
  // the experts is in flight.
  if (overlap_shared_) {
    shared_overlaps_.combine_backward += dispatcher_->in_flight();
    shared_->backward_fc2(dy_TH, dy_in);
  }
  {
    ScopedPhase phase(Phase::Permute);
    dispatcher_->combine_backward_finish();
  }
  experts_.backward(dx_NH_, dp_N_, dy_NH_, dy16_NH_);
  {
    ScopedPhase phase(Phase::Permute);
    if (rows16_) {
      dispatcher_->dispatch_backward16_start(dx_TH, dprobs_TK_, dx_NH_, back16_NH_, dp_N_);
    } else {
      dispatcher_->dispatch_backward_start(dx_TH, dprobs_TK_, dx_NH_, dp_N_);
    }
  }
  // Its second half (fc1's) while the gradients' all-to-all back is in flight; its input
  // gradient waits in its own buffer until the dispatch's backward has assigned dx.
  if (overlap_shared_) {
    shared_overlaps_.dispatch_backward += dispatcher_->in_flight();
    shared_->backward_fc1();
  }
  {
    ScopedPhase phase(Phase::Permute);
    dispatcher_->dispatch_backward_finish();
  }
  {
    ScopedPhase phase(Phase::Router);
    router_.backward(dx_TH, dprobs_TK_, loss_grad_scale);
  }
  if (!shared_) return;
  // dx = the dispatch's backward, + the router's, + the shared expert's: the same order with
  // the overlap.
  if (!overlap_shared_) shared_->backward_compute(dy_TH, dy_in);
  shared_->add_input_grad(dx_TH);
}

template class MoELayer<float>;
template class MoELayer<double>;

}  // namespace moecore::moe
