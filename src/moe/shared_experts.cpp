#include "moe/shared_experts.h"

#include "core/check.h"
#include "ops/add.h"
#include "ops/gemm.h"
#include "ops/sigmoid_gate.h"

namespace moecore::moe {

template <typename T>
SharedExperts<T>::SharedExperts(const MoeLayerConfig& cfg, ParamRegistry& params,
                                const std::string& prefix)
    : H_(cfg.hidden) {
  MOE_CHECK(cfg.moe.shared_ffn_hidden > 0, "[moe] shared expert of width {} built",
            cfg.moe.shared_ffn_hidden);
  const std::string name = prefix + ".shared_experts";
  mlp_ = std::make_unique<nn::MLP<T>>(cfg.hidden, cfg.moe.shared_ffn_hidden, cfg.activation,
                                      cfg.add_mlp_bias, cfg.init_std, cfg.output_init_std, params,
                                      name);
  if (cfg.moe.shared_expert_gate) {
    // Megatron: torch.empty((1, hidden)) initialised with config.init_method, after fc1 and fc2;
    // a 2-D weight, so weight decay applies.
    gate_ = &params.add(ParamSpec{name + ".gate_weight",
                                  {1, cfg.hidden},
                                  ParamInit::Normal,
                                  cfg.init_std,
                                  ParamKind::Dense,
                                  true,
                                  {}});
  }
}

template <typename T>
void SharedExperts<T>::allocate(Arena& a, int64_t max_tokens, const RecomputeModules& recompute,
                                bool rounded_rows, bool rounded_dy) {
  ex_ = &a.exec();
  const int64_t N = max_tokens, H = H_;
  if (!gated()) {
    mlp_->allocate(a, N, recompute.moe || recompute.shared_experts);
    if (rounded_rows) mlp_->input_rounded();
    if (rounded_dy) mlp_->output_grad_rounded();
    s_TH_ = a.alloc<T>(N * H, "moe.shared_out", MemKind::Workspace);
    return;
  }
  // Under "moe" the backward reruns this forward (it needs s and l again): the MLP then keeps
  // the rerun's fc1 output and activation (recomputed memory, like everything the layer
  // allocates under "moe") instead of recomputing them a second time.
  rerun_ = recompute.moe;
  mlp_->allocate(a, N, recompute.shared_experts && !recompute.moe);
  // The MLP's output gradient is sigmoid(l) dy, not the layer's rounded dy.
  if (rounded_rows) mlp_->input_rounded();
  s_TH_ = a.alloc<T>(N * H, "moe.shared_out");
  l_T_ = a.alloc<T>(N, "moe.shared_gate_logits");
  ds_TH_ = a.alloc<T>(N * H, "moe.shared_dout", MemKind::Workspace);
  dl_T_ = a.alloc<T>(N, "moe.shared_gate_dlogits", MemKind::Workspace);
}

template <typename T>
void SharedExperts<T>::shared_and_logits(int64_t n) {
  mlp_->forward(s_TH_, x_mlp_TH_, n);
  ops::linear_forward(*ex_, l_T_, x_TH_, gate_->compute_as<T>(), n, 1, H_);
}

template <typename T>
void SharedExperts<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH,
                               int64_t n_tok) {
  n_tok_ = n_tok;
  x_TH_ = x_TH;
  x_mlp_TH_ = x_mlp_TH;
  if (!gated()) {
    mlp_->forward(s_TH_, x_mlp_TH, n_tok);
    ops::add(*ex_, y_TH, y_TH, s_TH_, n_tok * H_);
    return;
  }
  shared_and_logits(n_tok);
  ops::sigmoid_gate_forward(*ex_, y_TH, s_TH_, l_T_, n_tok, H_);
}

template <typename T>
void SharedExperts<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH) {
  const int64_t n = n_tok_, H = H_;
  if (!gated()) {
    mlp_->backward(s_TH_, dy_mlp_TH);
    ops::add(*ex_, dx_TH, dx_TH, s_TH_, n * H);
    return;
  }
  if (rerun_) shared_and_logits(n);  // the forward's arithmetic again: the same bits
  ops::sigmoid_gate_backward(*ex_, ds_TH_, dl_T_, dy_TH, s_TH_, l_T_, n, H);
  // dx += dl w_g (the gate's input gradient), dw_g += dl^T x.
  ops::linear_backward(*ex_, dx_TH, gate_->grad_as<T>(), dl_T_, x_TH_, gate_->compute_as<T>(), n, 1, H,
                       /*accumulate_dx=*/true);
  mlp_->backward(s_TH_, ds_TH_);  // s is spent: it takes the MLP's input gradient
  ops::add(*ex_, dx_TH, dx_TH, s_TH_, n * H);
}

template class SharedExperts<float>;
template class SharedExperts<double>;

}  // namespace moecore::moe
