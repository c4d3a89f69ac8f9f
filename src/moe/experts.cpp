#include "moe/experts.h"

#include "core/check.h"

namespace moecore::moe {

template <typename T>
GroupedExperts<T>::GroupedExperts(int64_t num_experts, int64_t first_expert, int64_t num_local,
                                  nn::MlpShape sh, double init_std, double out_init_std,
                                  ParamRegistry& params, const std::string& prefix)
    : L_(num_local), sh_(sh) {
  MOE_CHECK(num_local >= 1 && first_expert >= 0 && first_expert + num_local <= num_experts,
            "[experts] local experts [{}, {}) outside [0, {})", first_expert,
            first_expert + num_local, num_experts);
  const int64_t H = sh.H, F = sh.F, F1 = sh.F1();
  ParamSlice slice{0, first_expert, num_local};
  fc1_ = &params.add(ParamSpec{prefix + ".experts.linear_fc1.weight",
                               {num_experts, F1, H},
                               ParamInit::Normal,
                               init_std,
                               ParamKind::Expert,
                               true,
                               slice,
                               /*bf16_only=*/true});
  fc2_ = &params.add(ParamSpec{prefix + ".experts.linear_fc2.weight",
                               {num_experts, H, F},
                               ParamInit::Normal,
                               out_init_std,
                               ParamKind::Expert,
                               true,
                               slice,
                               /*bf16_only=*/true});
  if (sh.bias) {
    // Megatron: zeros, no weight decay; sliced over EP like the weights.
    fc1_bias_ = &params.add(ParamSpec{prefix + ".experts.linear_fc1.bias",
                                      {num_experts, F1},
                                      ParamInit::Zeros,
                                      0.0,
                                      ParamKind::Expert,
                                      false,
                                      slice});
    fc2_bias_ = &params.add(ParamSpec{prefix + ".experts.linear_fc2.bias",
                                      {num_experts, H},
                                      ParamInit::Zeros,
                                      0.0,
                                      ParamKind::Expert,
                                      false,
                                      slice});
  }
}

template <typename T>
void GroupedExperts<T>::allocate(Arena& a, int64_t max_rows, nn::MlpRecompute recompute) {
  nn::mlp_allocate(saved_, a, max_rows, sh_, "experts.saved", fc1_, fc2_, recompute);
  da_ = a.alloc<T>(max_rows * sh_.F, "experts.da", MemKind::Workspace);
  dh_ = a.alloc<T>(max_rows * sh_.F1(), "experts.dh", MemKind::Workspace);
}

template <typename T>
void GroupedExperts<T>::output_grad_rounded() {
  MOE_CHECK(!sh_.bias, "[experts] with biases dy must arrive in f32 (fc2's bias gradient sums it)");
  saved_.dy_rounded = saved_.widened;
}

template <typename T>
nn::MlpParams<DevPtr<const T>> GroupedExperts<T>::values() const {
  return nn::mlp_values<T>(*fc1_, *fc2_, fc1_bias_, fc2_bias_);
}

template <typename T>
void GroupedExperts<T>::forward(DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
                                DevPtr<const int64_t> rows_per_expert_L, int64_t N) {
  nn::mlp_forward(saved_, y_NH, x_NH, p_N, rows_per_expert_L, L_, N, values(), sh_);
}

template <typename T>
void GroupedExperts<T>::backward(DevPtr<T> dx_NH, DevPtr<T> dp_N, DevPtr<const T> dy_NH) {
  const nn::MlpParams<DevPtr<T>> grad = nn::mlp_grads<T>(*fc1_, *fc2_, fc1_bias_, fc2_bias_);
  nn::mlp_backward(saved_, dx_NH, dp_N, grad, dy_NH, values(), sh_, da_, dh_);
}

template class GroupedExperts<float>;
template class GroupedExperts<double>;

}  // namespace moecore::moe
