// Routed experts as one grouped MLP: per local expert e, fc1 [2F, H] ([gate; up]) and
// fc2 [H, F], stored as the expert-parallel slices of global tensors [E, 2F, H] and [E, H, F]
// so a parameter's values do not depend on the layout. The routing prob multiplies the
// activation (a = silu(gate) * up * p), so combine is a plain sum.
// Legend: N rows, H hidden, F expert ffn, E experts, L local experts.
#pragma once

#include <cstdint>
#include <string>

#include "nn/swiglu_mlp.h"

namespace moecore::moe {

template <typename T>
class GroupedExperts {
 public:
  // Holds experts [first_expert, first_expert + num_local) of num_experts.
  GroupedExperts(int64_t num_experts, int64_t first_expert, int64_t num_local, int64_t hidden,
                 int64_t ffn, double init_std, double out_init_std, ParamRegistry& params,
                 const std::string& prefix);
  // recompute: what the backward recomputes (moe_act: the activation; moe: fc1 too).
  void allocate(Arena& arena, int64_t max_rows, nn::SwigluRecompute recompute = {});
  // As nn::MLP's: after allocate(), rows of bf16 values skip the rounding passes.
  bool widened_bf16() const { return saved_.widened; }
  void input_rounded() { saved_.x_rounded = saved_.widened; }
  void output_grad_rounded() { saved_.dy_rounded = saved_.widened; }
  // x [N, H] expert-major with rows_per_expert_L; p [N]; y [N, H] assigned.
  void forward(DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
               DevPtr<const int64_t> rows_per_expert_L, int64_t N);
  // dx, dp assigned; weight grads accumulated.
  void backward(DevPtr<T> dx_NH, DevPtr<T> dp_N, DevPtr<const T> dy_NH);

  int64_t num_local() const { return L_; }
  const Param& fc1() const { return *fc1_; }
  const Param& fc2() const { return *fc2_; }

 private:
  int64_t L_;
  nn::SwigluMlpShape sh_;
  Param* fc1_;  // [L, 2F, H] of global [E, 2F, H]
  Param* fc2_;  // [L, H, F] of global [E, H, F]
  nn::SwigluMlpSaved<T> saved_;
  DevPtr<T> da_ = nullptr;
  DevPtr<T> dh_ = nullptr;
};

}  // namespace moecore::moe
