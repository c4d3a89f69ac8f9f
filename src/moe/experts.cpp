#include "moe/experts.h"

#include <type_traits>

#include "core/check.h"
#include "ops/memory.h"

namespace moecore::moe {

template <typename T>
GroupedExperts<T>::GroupedExperts(int64_t num_experts, int64_t first_expert, int64_t num_local,
                                  nn::MlpShape sh, double init_std, double out_init_std,
                                  ParamRegistry& params, const std::string& prefix, TpShard etp)
    : L_(num_local), etp_(etp), sh_(sh) {
  MOE_CHECK(num_local >= 1 && first_expert >= 0 && first_expert + num_local <= num_experts,
            "[experts] local experts [{}, {}) outside [0, {})", first_expert,
            first_expert + num_local, num_experts);
  MOE_CHECK(etp.size >= 1 && etp.rank >= 0 && etp.rank < etp.size && sh.F % etp.size == 0,
            "[experts] --moe-ffn-hidden-size {} is not divisible by "
            "--expert-tensor-parallel-size {}: every expert-TP rank holds F/ETP of each "
            "expert's ffn width; pick an ETP that divides {}",
            sh.F, etp.size, sh.F);
  const int64_t H = sh.H, F = sh.F, F1 = sh.F1();
  const int parts = static_cast<int>(F1 / F);  // SwiGLU's [gate; up]: two
  sh_.F = F / etp.size;                          // this rank's share, in every GEMM
  ParamSlice slice{0, first_expert, num_local};
  ParamSlice fc1_slice = slice, fc2_slice = slice, fc1_bias_slice = slice;
  if (etp.size > 1) {
    const int64_t f = sh_.F, off = etp.rank * f;
    fc1_slice.second = DimSlice{1, off, f, parts};
    fc2_slice.second = DimSlice{2, off, f, 1};
    fc1_bias_slice.second = DimSlice{1, off, f, parts};
  }
  ParamSpec fc1{prefix + ".experts.linear_fc1.weight",
                {num_experts, F1, H},
                ParamInit::Normal,
                init_std,
                ParamKind::Expert,
                true,
                fc1_slice,
                /*bf16_only=*/true};
  ParamSpec fc2{prefix + ".experts.linear_fc2.weight",
                {num_experts, H, F},
                ParamInit::Normal,
                out_init_std,
                ParamKind::Expert,
                true,
                fc2_slice,
                /*bf16_only=*/true};
  fc1.tp_role = fc2.tp_role = TpRole::Sharded;
  fc1_ = &params.add(fc1);
  fc2_ = &params.add(fc2);
  if (sh.bias) {
    // Megatron: zeros, no weight decay; sliced over EP like the weights, fc1's over ETP too;
    // fc2's replicated over ETP and added once.
    ParamSpec b1{prefix + ".experts.linear_fc1.bias",
                 {num_experts, F1},
                 ParamInit::Zeros,
                 0.0,
                 ParamKind::Expert,
                 false,
                 fc1_bias_slice};
    ParamSpec b2{prefix + ".experts.linear_fc2.bias",
                 {num_experts, H},
                 ParamInit::Zeros,
                 0.0,
                 ParamKind::Expert,
                 false,
                 slice};
    b1.tp_role = TpRole::Sharded;
    b2.tp_role = TpRole::ReplicatedPartialGrad;
    fc1_bias_ = &params.add(b1);
    fc2_bias_ = &params.add(b2);
  }
}

template <typename T>
void GroupedExperts<T>::allocate(Arena& a, int64_t max_rows, nn::MlpRecompute recompute) {
  nn::mlp_allocate(saved_, a, max_rows, sh_, "experts.saved", fc1_, fc2_, recompute, L_);
  da_ = a.alloc<T>(max_rows * sh_.F, "experts.da", MemKind::Workspace);
  dh_ = a.alloc<T>(max_rows * sh_.F1(), "experts.dh", MemKind::Workspace);
  saved_.fc1_f32 = saved_.h16_NF1 ? dh_ : nullptr;  // fc1's f32 products under --bf16
  if (sh_.bias && !adds_fc2_bias()) {
    zero_bias_LH_ = a.alloc<T>(L_ * sh_.H, "experts.zero_fc2_bias");
    dropped_bias_grad_LH_ = a.alloc<T>(L_ * sh_.H, "experts.dropped_fc2_bias_grad",
                                       MemKind::Workspace);
  }
}

template <typename T>
void GroupedExperts<T>::output_grad_rounded() {
  MOE_CHECK(!sh_.bias, "[experts] with biases dy must arrive in f32 (fc2's bias gradient sums it)");
  saved_.dy_rounded = saved_.widened;
}

template <typename T>
nn::MlpParams<DevPtr<const T>> GroupedExperts<T>::values() const {
  nn::MlpParams<DevPtr<const T>> w = nn::mlp_values<T>(*fc1_, *fc2_, fc1_bias_, fc2_bias_);
  if (sh_.bias && !adds_fc2_bias()) w.fc2_bias = zero_bias_LH_;
  return w;
}

template <typename T>
void GroupedExperts<T>::forward(DevPtr<T> y_NH, DevPtr<const T> x_NH, DevPtr<const T> p_N,
                                DevPtr<const int64_t> rows_per_expert_L, int64_t N,
                                int64_t fixed_rows) {
  if (sh_.bias && !adds_fc2_bias()) ops::zero(*saved_.ex, zero_bias_LH_, L_ * sh_.H);
  nn::mlp_forward(saved_, y_NH, x_NH, p_N, rows_per_expert_L, L_, N, values(), sh_, fixed_rows);
}

template <typename T>
void GroupedExperts<T>::forward(DevPtr<T> y_NH, DevPtr<const bf16> x16_NH, DevPtr<const T> p_N,
                                DevPtr<const int64_t> rows_per_expert_L, int64_t N,
                                int64_t fixed_rows) {
  if constexpr (std::is_same_v<T, float>) {
    if (sh_.bias && !adds_fc2_bias()) ops::zero(*saved_.ex, zero_bias_LH_, L_ * sh_.H);
    nn::mlp_forward(saved_, y_NH, x16_NH, p_N, rows_per_expert_L, L_, N, values(), sh_,
                    fixed_rows);
  } else {
    MOE_FAIL("[experts] bf16 input rows are for the f32 model under --bf16");
  }
}

template <typename T>
void GroupedExperts<T>::backward(DevPtr<T> dx_NH, DevPtr<T> dp_N, DevPtr<const T> dy_NH,
                                 DevPtr<const bf16> dy16_NH) {
  nn::MlpParams<DevPtr<T>> grad = nn::mlp_grads<T>(*fc1_, *fc2_, fc1_bias_, fc2_bias_);
  if (sh_.bias && !adds_fc2_bias()) grad.fc2_bias = dropped_bias_grad_LH_;
  nn::mlp_backward(saved_, dx_NH, dp_N, grad, dy_NH, values(), sh_, da_, dh_, dy16_NH);
}

template class GroupedExperts<float>;
template class GroupedExperts<double>;

}  // namespace moecore::moe
