// Routed experts as one grouped MLP: per local expert e, fc1 [F1, H] (F1 = 2F, [gate; up], for
// SwiGLU; F for the element-wise activations) and fc2 [H, F], with biases fc1 [F1] and fc2 [H],
// stored as the expert-parallel slices of global tensors [E, F1, H], [E, H, F], [E, F1], [E, H]
// so a parameter's values do not depend on the layout. The routing prob multiplies the
// activation (a = act(h) * p) and fc2's bias (as Megatron's), so combine is a plain sum.
// Expert tensor parallelism (ETP > 1) splits the ffn width F inside each expert: fc1's rows
// (this rank's F/ETP of the gate and of the up half for SwiGLU) and fc1's bias, fc2's columns;
// the outputs are partial sums over ETP that the dispatcher's combine adds. fc2's bias is
// replicated over ETP and added once, by ETP rank 0 (the others add zeros, and their gradient
// of it stays zero: TpRole::ReplicatedPartialGrad).
// Legend: N rows, H hidden, F expert ffn, F1 fc1's width, E experts, L local experts.
#pragma once

#include <cstdint>
#include <string>

#include "nn/mlp.h"

namespace moecore::moe {

template <typename T>
class GroupedExperts {
 public:
  // Holds experts [first_expert, first_expert + num_local) of num_experts.
  // sh: hidden, expert ffn width (the whole F), activation, biases. etp: this rank's place in
  // the expert tensor-parallel group (its size must divide F).
  GroupedExperts(int64_t num_experts, int64_t first_expert, int64_t num_local, nn::MlpShape sh,
                 double init_std, double out_init_std, ParamRegistry& params,
                 const std::string& prefix, TpShard etp = {});
  // recompute: what the backward recomputes (moe_act: the activation; moe: fc1 too).
  void allocate(Arena& arena, int64_t max_rows, nn::MlpRecompute recompute = {});
  // As nn::MLP's: after allocate(), rows of bf16 values skip the rounding passes.
  bool widened_bf16() const { return saved_.widened; }
  void input_rounded() { saved_.x_rounded = saved_.widened; }
  // Not with biases: fc2's bias gradient sums dy's f32 values.
  void output_grad_rounded();
  bool has_bias() const { return sh_.bias; }
  // --bf16 (after allocate()): the GEMMs read bf16 (native, or widened), so the rows may arrive
  // cast to bf16 (the bf16 forms below).
  bool reads_bf16_rows() const { return saved_.gemm16; }
  // x [N, H] expert-major with rows_per_expert_L; p [N]; y [N, H] assigned. fixed_rows > 0:
  // every local expert has exactly that many rows (padded dispatch: DispatchPlan's
  // rows_per_expert), so the GEMMs need not read rows_per_expert_L (nn::MlpSaved).
  void forward(DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
               DevPtr<const int64_t> rows_per_expert_L, int64_t N, int64_t fixed_rows = 0);
  // The same on rows cast to bf16 (reads_bf16_rows()), kept by the caller until the backward:
  // bitwise the forward on the f32 rows they were cast from.
  void forward(DevPtr<T> y_NH, DevPtr<const bf16> x16_NH, DevPtr<const T> p_N,
               DevPtr<const int64_t> rows_per_expert_L, int64_t N, int64_t fixed_rows = 0);
  // dx, dp assigned; weight and bias grads accumulated. dy16_NH: dy cast to bf16 instead (no
  // biases; dy_NH then null), bitwise the backward on the f32 dy it was cast from.
  void backward(DevPtr<T> dx_NH, DevPtr<T> dp_N, DevPtr<const T> dy_NH,
                DevPtr<const bf16> dy16_NH = nullptr);

  int64_t num_local() const { return L_; }
  const TpShard& etp() const { return etp_; }
  const Param& fc1() const { return *fc1_; }
  const Param& fc2() const { return *fc2_; }
  const Param* fc1_bias() const { return fc1_bias_; }  // null without biases
  const Param* fc2_bias() const { return fc2_bias_; }

 private:
  int64_t L_;
  TpShard etp_;
  nn::MlpParams<DevPtr<const T>> values() const;
  nn::MlpShape sh_;  // F is this rank's F/ETP
  Param* fc1_;  // [L, F1/ETP, H] of global [E, F1, H]
  Param* fc2_;  // [L, H, F/ETP] of global [E, H, F]
  Param* fc1_bias_ = nullptr;  // [L, F1/ETP] of global [E, F1]
  Param* fc2_bias_ = nullptr;  // [L, H] of global [E, H]
  // ETP rank > 0: the zeros its MLP adds as fc2's bias and where that bias's gradient goes.
  DevPtr<T> zero_bias_LH_ = nullptr;
  DevPtr<T> dropped_bias_grad_LH_ = nullptr;
  bool adds_fc2_bias() const { return etp_.rank == 0; }
  nn::MlpSaved<T> saved_;
  DevPtr<T> da_ = nullptr;
  DevPtr<T> dh_ = nullptr;
};

}  // namespace moecore::moe
