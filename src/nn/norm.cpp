#include "nn/norm.h"

#include <type_traits>

#include "ops/layernorm.h"
#include "ops/rmsnorm.h"

namespace moecore::nn {

template <typename T>
Norm<T>::Norm(const NormConfig& cfg, ParamRegistry& params, const std::string& prefix,
              TpRole tp_role)
    : cfg_(cfg) {
  // Megatron: gamma starts at 1, stored as 0 with --apply-layernorm-1p; beta at 0. No decay.
  weight_ = &params.add(ParamSpec{prefix + ".weight",
                                  {cfg.H},
                                  cfg.one_p ? ParamInit::Zeros : ParamInit::Ones,
                                  0.0,
                                  ParamKind::Dense,
                                  false,
                                  {}});
  weight_->spec.tp_role = tp_role;
  if (cfg.layernorm) {
    bias_ = &params.add(
        ParamSpec{prefix + ".bias", {cfg.H}, ParamInit::Zeros, 0.0, ParamKind::Dense, false, {}});
    bias_->spec.tp_role = tp_role;
  }
}

template <typename T>
void Norm<T>::allocate(Arena& a, int64_t n_tok, const char* name) {
  rstd_ = a.alloc<T>(n_tok, name);
  if (cfg_.layernorm) mean_ = a.alloc<T>(n_tok, name);
}

template <typename T>
void Norm<T>::forward(const Exec& ex, DevPtr<T> y, DevPtr<const T> x, int64_t n, bool round) {
  const DevPtr<const T> w = weight_->compute_as<T>();
  if (cfg_.layernorm) {
    const DevPtr<const T> b = bias_->compute_as<T>();
    if constexpr (std::is_same_v<T, float>) {
      if (round)
        return ops::layernorm_forward_bf16w(ex, y, mean_, rstd_, x, w, b, n, cfg_.H, cfg_.eps,
                                            cfg_.one_p);
    }
    return ops::layernorm_forward(ex, y, mean_, rstd_, x, w, b, n, cfg_.H, cfg_.eps, cfg_.one_p);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (round) return ops::rmsnorm_forward_bf16w(ex, y, rstd_, x, w, n, cfg_.H, cfg_.eps);
  }
  ops::rmsnorm_forward(ex, y, rstd_, x, w, n, cfg_.H, cfg_.eps);
}

template <typename T>
void Norm<T>::backward(const Exec& ex, DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x,
                       int64_t n) {
  if (cfg_.layernorm) {
    return ops::layernorm_backward(ex, dx, weight_->grad_as<T>(), bias_->grad_as<T>(), dy, x,
                                   weight_->compute_as<T>(), DevPtr<const T>(mean_),
                                   DevPtr<const T>(rstd_), n, cfg_.H, cfg_.one_p);
  }
  ops::rmsnorm_backward(ex, dx, weight_->grad_as<T>(), dy, x, weight_->compute_as<T>(),
                        DevPtr<const T>(rstd_), n, cfg_.H);
}

template class Norm<float>;
template class Norm<double>;

}  // namespace moecore::nn
