// The MoE layer only sequences the phases: route -> dispatch -> experts -> combine
// (+ the shared expert on the same input). Backward runs them in reverse, reusing the plan.
// Legend: T tokens, H hidden, K top-k, N rows for the local experts.
#pragma once

#include <memory>
#include <string>

#include "moe/config.h"
#include "moe/dispatcher.h"
#include "moe/experts.h"
#include "moe/router.h"
#include "moe/shared_experts.h"

namespace moecore::moe {

template <typename T>
class MoELayer {
 public:
  // groups: null = one rank. The dispatcher comes from make_dispatcher(cfg, groups); the
  // experts are this rank's E/EP slice, [ep_rank * L, (ep_rank + 1) * L), each expert's F/ETP
  // share under expert tensor parallelism. With attention TP > 1 the layer's tokens are this
  // rank's sequence slice of the micro-batch (n / TP tokens, whether or not the model runs with
  // --sequence-parallel): the router's weight gets partial gradients (summed over TP by the
  // gradient reduction) and the aux / z losses reduce over TP x CP (Router::set_token_group).
  MoELayer(const MoeLayerConfig& cfg, ParamRegistry& params, const std::string& prefix,
           const parallel::ProcessGroups* groups = nullptr);
  // A given dispatcher (tests); its first_local_expert() decides the experts held, groups the
  // rest as above.
  MoELayer(const MoeLayerConfig& cfg, ParamRegistry& params, const std::string& prefix,
           std::unique_ptr<TokenDispatcher<T>> dispatcher,
           const parallel::ProcessGroups* groups = nullptr);

  // Selective recomputation (cfg.recompute): "moe" keeps only the input and reruns routing,
  // dispatch and the experts' fc1 in the backward; "moe_act" recomputes the experts'
  // activation; "shared_experts" the shared expert's fc1 and activation (shared_experts.h:
  // with the gate, what its backward needs).
  void allocate(Arena& arena, int64_t max_tokens);
  // --bf16 (T = float, the experts' GEMMs on bf16 copies of their weights): the tokens are cast
  // to bf16 once before the dispatch and the permutation, all-to-all and ETP gather move bf16
  // rows, which the experts' fc1 GEMMs read as they are; without MLP biases the output gradient
  // takes the same way through the combine's backward to the fc2 GEMMs. Bitwise what the f32
  // rows gave (the GEMMs cast them to bf16 themselves), with half the bytes moved and the saved
  // expert rows half the size. On by default; off (before allocate()) moves f32 rows as before,
  // which the tests compare with.
  // The way back moves bf16 rows too (as Megatron's bf16 expert outputs): fc2's output rows (the
  // f32 GEMM result and bias) are rounded once to bf16 for the combine, and fc1's input-gradient
  // rows for the dispatch's backward (under expert TP after the reduce-scatter has summed the
  // partials in f32); the all-to-all moves them as bf16 and each token sums its rows widened, in
  // f32, in k order (dispatcher.h's combine16 / dispatch_backward16). The parameters' gradients
  // stay bitwise those of the f32 rows; the output and the input gradient carry the one rounding
  // per row.
  void set_bf16_dispatch(bool on) { bf16_dispatch_ = on; }
  // Before allocate(): the input arrives as bf16 values (its producer rounded it: the block's
  // n2 under --bf16 with the bf16 residual stream, Megatron-Core's bf16 hidden states), so the
  // widened bf16 path's GEMMs read it as it is, without the rounded copy (x16w_TH_).
  void input_rounded() { input_rounded_ = true; }
  bool bf16_rows() const { return rows16_; }   // after allocate(): the tokens move as bf16
  bool bf16_dy_rows() const { return dy16_; }  // the output gradient too
  // recompute: the backward's rerun of the last forward (full recomputation of the layer).
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, int64_t n_tok, bool recompute = false);
  // dx assigned; loss_grad_scale multiplies the aux/z-loss gradients.
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, double loss_grad_scale);
  // Once per optimizer step: the router's expert-bias / quantile updates and accumulator reset.
  void finish_step(const RouterStepSync& sync = {}) { router_.finish_step(sync); }
  void set_training(bool training) { router_.set_training(training); }

  const std::string& prefix() const { return prefix_; }  // "decoder.layers.3.mlp"
  RoutingReplayMode routing_replay() const { return routing_replay_; }
  const Router<T>& router() const { return router_; }
  Router<T>& router() { return router_; }
  const GroupedExperts<T>& experts() const { return experts_; }
  const SharedExperts<T>* shared_experts() const { return shared_.get(); }  // null: none
  const DispatchPlan& plan() const { return *plan_; }
  const TokenDispatcher<T>& dispatcher() const { return *dispatcher_; }

  // --moe-shared-expert-overlap (with a shared expert): the shared expert's work runs in four
  // windows, while a dispatcher collective is in flight (Megatron's SharedExpertMLP schedule):
  // its gate logits, TP all-gather, fc1 and activation during the dispatch; fc2 and its TP
  // reduce-scatter during the combine; in the backward, fc2's and the activation's backward
  // (and the TP all-gathers) during the combine's backward, fc1's backward and its TP
  // reduce-scatter during the dispatch's backward. On a device the collectives run on the
  // communicators' streams, the shared expert's kernels on the layer's, ordered only by the
  // events of the async forms (start ... wait_on). The outputs and gradients are bitwise those
  // without the flag (the shared expert's output and input gradient are added at the same
  // points, in the same order). Counted per window: the pieces that ran while the dispatcher had
  // a collective in flight (none without an EP all-to-all: the local and allgather dispatchers
  // finish in start).
  bool overlaps_shared_expert() const { return overlap_shared_; }
  struct SharedOverlaps {
    int64_t dispatch = 0, combine = 0, combine_backward = 0, dispatch_backward = 0;
  };
  const SharedOverlaps& shared_expert_overlaps() const { return shared_overlaps_; }

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // Routing, the plan and the dispatch; shared_in_flight: the shared expert's forward between
  // the dispatch's start and finish.
  void route_and_dispatch(DevPtr<const T> x_TH, int64_t n_tok, bool recompute,
                          bool shared_in_flight);
  void shared_forward_in_flight();
  bool overlap_shared_ = false;
  SharedOverlaps shared_overlaps_;
  std::string prefix_;
  RoutingReplayMode routing_replay_;

  int64_t H_, K_;
  // Splits the tokens into sequences for seq_aux_loss: the sequence positions this rank holds
  // (S / TP with a TP slice of the micro-batch: [rank * S / TP, +S / TP) of every sequence).
  int64_t seq_length_;
  bool pad_to_capacity_;
  // Widened bf16 without MLP biases: dy is rounded once too, dy16w_TH_ (fc2's bias gradients
  // need dy's f32 values, so with biases the experts round it themselves). With bf16 rows only
  // for the shared expert.
  bool round_dy_ = false;
  bool round_rows_ = false;  // widened bf16: the GEMMs read the input's bf16 values, x16w_TH_
  bool input_rounded_ = false;  // input_rounded(): they read the input itself
  bool bf16_dispatch_ = true;
  bool rows16_ = false;  // the tokens dispatched as bf16: x16_TH_ -> x16_NH_
  bool dy16_ = false;    // the output gradient too: dy16_TH_ -> dy16_NH_ (no MLP biases)
  RecomputeModules recompute_;
  Router<T> router_;
  std::unique_ptr<TokenDispatcher<T>> dispatcher_;
  GroupedExperts<T> experts_;
  std::unique_ptr<SharedExperts<T>> shared_;  // null without a shared expert
  const DispatchPlan* plan_ = nullptr;
  int64_t n_tok_ = 0;
  DevPtr<const T> x_TH_ = nullptr;  // the forward's input, owned by the caller until backward
  // Expert-side rows and their gradients.
  DevPtr<T> x16w_TH_ = nullptr;
  DevPtr<T> dy16w_TH_ = nullptr;
  DevPtr<const T> gemm_input(DevPtr<const T> x_TH) const {
    return round_rows_ ? DevPtr<const T>(x16w_TH_) : x_TH;
  }
  DevPtr<bf16> x16_TH_ = nullptr;
  DevPtr<bf16> x16_NH_ = nullptr;
  DevPtr<bf16> dy16_TH_ = nullptr;
  DevPtr<bf16> dy16_NH_ = nullptr;
  DevPtr<T> x_NH_ = nullptr;
  DevPtr<T> p_N_ = nullptr;
  DevPtr<T> y_NH_ = nullptr;
  // rows16_: where the dispatcher rounds fc2's output rows (combine) and the input-gradient rows
  // (the dispatch's backward) once.
  DevPtr<bf16> back16_NH_ = nullptr;
  DevPtr<T> dy_NH_ = nullptr;
  DevPtr<T> dx_NH_ = nullptr;
  DevPtr<T> dp_N_ = nullptr;
  DevPtr<T> dprobs_TK_ = nullptr;
};

}  // namespace moecore::moe
