#include "moe/experts.h"

#include "core/check.h"

namespace moecore::moe {

template <typename T>
GroupedExperts<T>::GroupedExperts(int64_t num_experts, int64_t first_expert, int64_t num_local,
                                  int64_t hidden, int64_t ffn, double init_std,
                                  double out_init_std, ParamRegistry& params,
                                  const std::string& prefix)
    : L_(num_local), sh_{hidden, ffn} {
  MOE_CHECK(num_local >= 1 && first_expert >= 0 && first_expert + num_local <= num_experts,
            "[experts] local experts [{}, {}) outside [0, {})", first_expert,
            first_expert + num_local, num_experts);
  ParamSlice slice{0, first_expert, num_local};
  fc1_ = &params.add(ParamSpec{prefix + ".experts.linear_fc1.weight", {num_experts, 2 * ffn, hidden},
                               ParamInit::Normal, init_std, ParamKind::Expert, true, slice});
  fc2_ = &params.add(ParamSpec{prefix + ".experts.linear_fc2.weight", {num_experts, hidden, ffn},
                               ParamInit::Normal, out_init_std, ParamKind::Expert, true, slice});
}

template <typename T>
void GroupedExperts<T>::allocate(Arena& a, int64_t max_rows, nn::SwigluRecompute recompute) {
  nn::swiglu_mlp_allocate(saved_, a, max_rows, sh_, "experts.saved", fc1_, fc2_, recompute);
  da_ = a.alloc<T>(max_rows * sh_.F, "experts.da", MemKind::Workspace);
  dh_ = a.alloc<T>(max_rows * 2 * sh_.F, "experts.dh", MemKind::Workspace);
}

template <typename T>
void GroupedExperts<T>::forward(DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
                                DevPtr<const int64_t> rows_per_expert_L, int64_t N) {
  nn::swiglu_mlp_forward(saved_, y_NH, x_NH, p_N, rows_per_expert_L, L_, N,
                            fc1_->data_as<T>(), fc2_->data_as<T>(), sh_);
}

template <typename T>
void GroupedExperts<T>::backward(DevPtr<T> dx_NH, DevPtr<T> dp_N, DevPtr<const T> dy_NH) {
  nn::swiglu_mlp_backward(saved_, dx_NH, dp_N, fc1_->grad_as<T>(), fc2_->grad_as<T>(), dy_NH,
                             fc1_->data_as<T>(), fc2_->data_as<T>(), sh_, da_, dh_);
}

template class GroupedExperts<float>;
template class GroupedExperts<double>;

}  // namespace moecore::moe
