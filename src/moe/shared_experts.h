// The shared expert (Megatron's SharedExpertMLP): a dense MLP on the MoE layer's input (the
// layer's activation and biases),
// added to the routed experts' output. With --moe-shared-expert-gate its output is scaled per
// token by sigmoid(x w_g^T), w_g = shared_experts.gate_weight [1, H] (Qwen2-MoE). Like the
// router it is replicated over EP: its parameters are dense, their grads reduced over DP.
// Tensor parallelism: the MoE layer's tokens are this rank's sequence slice whenever tp > 1, so
// the MLP is a TP region with sequence parallelism (the attention grid's TP group): its input
// all-gathered over TP, fc1 column- and fc2 row-parallel (nn::MLP), its output reduce-scattered
// back to the slice. The gate reads only the slice: its gradient is a partial sum over TP.
// Legend: T tokens (this rank's), H hidden, F shared expert width.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/arena.h"
#include "moe/config.h"
#include "nn/param_registry.h"
#include "nn/mlp.h"
#include "parallel/tensor_parallel.h"

namespace moecore::moe {

template <typename T>
class SharedExperts {
 public:
  // prefix names the MoE layer ("decoder.layers.3.mlp"); cfg.moe.shared_ffn_hidden > 0.
  // groups: null = one rank; the MLP takes the attention grid's TP group from it.
  SharedExperts(const MoeLayerConfig& cfg, ParamRegistry& params, const std::string& prefix,
                const parallel::ProcessGroups* groups = nullptr);

  // recompute: the modules of the MoE layer ("moe", "shared_experts"). rounded_rows: widened
  // bf16, the MLP's input arrives as bf16 values (the MoE layer rounded it); rounded_dy: its
  // output gradient too (never with biases).
  // The gate's backward needs the shared output: it is kept (an activation); under "moe" the
  // backward reruns this forward instead, and the MLP keeps what the rerun recomputed.
  void allocate(Arena& arena, int64_t max_tokens, const RecomputeModules& recompute,
                bool rounded_rows, bool rounded_dy);
  // y += shared(x) [* sigmoid(x w_g^T)]. x_TH: the MoE layer's input, which the gate reads (in
  // the model dtype, as the router does: with --bf16 its f32 values and the f32 master weight);
  // x_mlp_TH: what the MLP's GEMMs read (x, or its bf16 values). Both owned by the caller until
  // backward. forward = compute then add_output.
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH, int64_t n_tok);
  // dx += the input gradient of the shared branch; weight grads accumulated. dy_mlp_TH: dy as
  // the ungated MLP's GEMMs read it (its bf16 values under widened bf16; else dy).
  // backward = backward_compute then add_input_grad.
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH);

  // The two passes in pieces that touch the layer's output / input gradient only in the last
  // (--moe-shared-expert-overlap: the MoE layer runs the others while dispatcher collectives are
  // in flight, as Megatron's SharedExpertMLP does: fc1 with the dispatch, fc2 with the combine;
  // fc2's backward with the combine's backward, fc1's with the dispatch's backward). Together
  // they run the one-call form's ops, the same arithmetic, and add into y / dx in the same order,
  // so the results are bitwise the same wherever the first pieces run.
  // The MLP's output and the gate logits (TP collectives under TP); y untouched.
  // compute = compute_fc1 then compute_fc2.
  void compute(DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH, int64_t n_tok);
  // The gate logits, the MLP's input gathered over TP, fc1 and the activation.
  void compute_fc1(DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH, int64_t n_tok);
  // fc2, its output reduce-scattered over TP: the shared output, kept.
  void compute_fc2();
  void add_output(DevPtr<T> y_TH);  // y += the shared output (gated: times sigmoid(l))
  // The weight gradients of the MLP and the MLP's input gradient (kept); gated, also the gate
  // logits' gradient. dx untouched. backward_compute = backward_fc2 then backward_fc1.
  void backward_compute(DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH);
  // Gated: the forward's rerun under "moe" recomputation and the gate's backward; the MLP's
  // input gathered again and dy gathered over TP; fc2's and the activation's backward. Reads dy
  // (the caller's, until this returns).
  void backward_fc2(DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH);
  // fc1's backward, its input gradient reduce-scattered over TP: kept.
  void backward_fc1();
  // dx += the gate's input gradient (gated; its weight gradient accumulated here too), then
  // dx += the MLP's input gradient.
  void add_input_grad(DevPtr<T> dx_TH);

  bool gated() const { return gate_ != nullptr; }
  const Param* gate_weight() const { return gate_; }

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // s = mlp(x_mlp) and the gate logits l = x w_g^T (the forward; also its rerun).
  void shared_and_logits(int64_t n_tok);
  void allocate_wire(Arena& a, int64_t n_full);  // wire16_ (after the MLP's allocate())
  // s (n_tok tokens) = the MLP on x_mlp: a TP region when tp > 1. In halves: the gathered
  // input, fc1 and the activation; fc2 and the reduce-scatter into s.
  void mlp_forward(DevPtr<T> s, int64_t n_tok);
  void mlp_forward_fc1(int64_t n_tok);
  void mlp_forward_fc2(DevPtr<T> s, int64_t n_tok);
  // ds_x (n_tok tokens) = the MLP's input gradient from dy (the MLP's output gradient). In
  // halves: the input gathered again, dy gathered, fc2's backward; fc1's and the reduce-scatter.
  void mlp_backward_fc2(DevPtr<const T> dy, int64_t n_tok);
  void mlp_backward_fc1(DevPtr<T> ds_x, int64_t n_tok);

  parallel::TensorParallel tp_;  // with sequence parallelism
  int64_t H_;
  std::unique_ptr<nn::MLP<T>> mlp_;
  Param* gate_ = nullptr;  // [1, H] with the gate
  bool rerun_ = false;     // gated under "moe" recomputation: backward reruns the forward
  int64_t n_tok_ = 0;
  DevPtr<const T> x_TH_ = nullptr;
  DevPtr<const T> x_mlp_TH_ = nullptr;
  DevPtr<T> s_TH_ = nullptr;   // the MLP's output, then its input gradient
  DevPtr<T> l_T_ = nullptr;    // gate logits (gated)
  DevPtr<T> ds_TH_ = nullptr;  // d(loss)/d(s) (gated)
  DevPtr<T> dl_T_ = nullptr;   // d(loss)/d(l) (gated)
  DevPtr<T> full_x_ = nullptr;  // tp > 1: the MLP's gathered input [T tp, H]
  DevPtr<T> full_y_ = nullptr;  // tp > 1: its partial output, then gradients [T tp, H]
  // --bf16, tp > 1: the bf16 staging of full_x_'s all-gather (TensorParallel::enter).
  DevPtr<bf16> wire16_ = nullptr;
};

}  // namespace moecore::moe
