#include "moe/shared_experts.h"

#include "core/check.h"
#include "ops/add.h"
#include "ops/gemm.h"
#include "ops/sigmoid_gate.h"

namespace moecore::moe {

template <typename T>
SharedExperts<T>::SharedExperts(const MoeLayerConfig& cfg, ParamRegistry& params,
                                const std::string& prefix,
                                const parallel::ProcessGroups* groups)
    : tp_(parallel::TensorParallel::attention(groups).with_sequence_parallel()), H_(cfg.hidden) {
  MOE_CHECK(cfg.moe.shared_ffn_hidden > 0, "[moe] shared expert of width {} built",
            cfg.moe.shared_ffn_hidden);
  const std::string name = prefix + ".shared_experts";
  mlp_ = std::make_unique<nn::MLP<T>>(cfg.hidden, cfg.moe.shared_ffn_hidden, cfg.activation,
                                      cfg.add_mlp_bias, cfg.init_std, cfg.output_init_std, params,
                                      name, tp_.shard());
  if (cfg.moe.shared_expert_gate) {
    // Megatron: torch.empty((1, hidden)) initialised with config.init_method, after fc1 and fc2;
    // a 2-D weight, so weight decay applies.
    gate_ = &params.add(ParamSpec{name + ".gate_weight",
                                  {1, cfg.hidden},
                                  ParamInit::Normal,
                                  cfg.init_std,
                                  ParamKind::Dense,
                                  true,
                                  {},
                                  false,
                                  tp_.shard().partial()});
  }
}

template <typename T>
void SharedExperts<T>::allocate(Arena& a, int64_t max_tokens, const RecomputeModules& recompute,
                                bool rounded_rows, bool rounded_dy) {
  ex_ = &a.exec();
  const int64_t N = max_tokens, H = H_;
  const int64_t N_full = N * tp_.size();  // the MLP's tokens: the whole TP group's
  if (tp_.active()) {
    full_x_ = a.alloc<T>(N_full * H, "moe.shared_in_full", MemKind::Workspace);
    full_y_ = a.alloc<T>(N_full * H, "moe.shared_out_full", MemKind::Workspace);
  }
  wire16_ = nullptr;
  if (!gated()) {
    mlp_->allocate(a, N_full, recompute.moe || recompute.shared_experts);
    allocate_wire(a, N_full);
    if (rounded_rows) mlp_->input_rounded();
    if (rounded_dy) mlp_->output_grad_rounded();
    s_TH_ = a.alloc<T>(N * H, "moe.shared_out", MemKind::Workspace);
    return;
  }
  // Under "moe" the backward reruns this forward (it needs s and l again): the MLP then keeps
  // the rerun's fc1 output and activation (recomputed memory, like everything the layer
  // allocates under "moe") instead of recomputing them a second time.
  rerun_ = recompute.moe;
  mlp_->allocate(a, N_full, recompute.shared_experts && !recompute.moe);
  allocate_wire(a, N_full);
  // The MLP's output gradient is sigmoid(l) dy, not the layer's rounded dy.
  if (rounded_rows) mlp_->input_rounded();
  s_TH_ = a.alloc<T>(N * H, "moe.shared_out");
  l_T_ = a.alloc<T>(N, "moe.shared_gate_logits");
  ds_TH_ = a.alloc<T>(N * H, "moe.shared_dout", MemKind::Workspace);
  dl_T_ = a.alloc<T>(N, "moe.shared_gate_dlogits", MemKind::Workspace);
}

// --bf16: the gathered input feeds only fc1's bf16 GEMMs (the gate reads this rank's x): it is
// all-gathered as bf16.
template <typename T>
void SharedExperts<T>::allocate_wire(Arena& a, int64_t n_full) {
  if (tp_.active() && mlp_->reads_input_as_bf16())
    wire16_ = a.alloc<bf16>(tp_.enter_wire_elems(n_full, H_), "moe.shared_in_wire16",
                            MemKind::Workspace);
}

template <typename T>
void SharedExperts<T>::mlp_forward_fc1(int64_t n_tok) {
  if (!tp_.active()) return mlp_->forward_fc1(x_mlp_TH_, n_tok);
  const int64_t n = n_tok * tp_.size();
  mlp_->forward_fc1(tp_.enter(*ex_, x_mlp_TH_, full_x_, n, H_, wire16_), n);
}

template <typename T>
void SharedExperts<T>::mlp_forward_fc2(DevPtr<T> s, int64_t n_tok) {
  if (!tp_.active()) return mlp_->forward_fc2(s);
  mlp_->forward_fc2(full_y_);
  tp_.leave(*ex_, full_y_, s, n_tok * tp_.size(), H_);
}

template <typename T>
void SharedExperts<T>::mlp_forward(DevPtr<T> s, int64_t n_tok) {
  mlp_forward_fc1(n_tok);
  mlp_forward_fc2(s, n_tok);
}

template <typename T>
void SharedExperts<T>::mlp_backward_fc2(DevPtr<const T> dy, int64_t n_tok) {
  if (!tp_.active()) return mlp_->backward_fc2(dy);
  const int64_t n = n_tok * tp_.size();
  // The forward's gathered input again (the MLP's backward reads it, its recomputation too).
  tp_.enter(*ex_, x_mlp_TH_, full_x_, n, H_, wire16_);
  // --bf16 without biases only fc2's bf16 GEMMs read the gathered output gradient: as bf16.
  mlp_->backward_fc2(tp_.leave_backward(*ex_, dy, full_y_, n, H_,
                                        mlp_->reads_output_grad_as_bf16() ? wire16_ : nullptr));
}

template <typename T>
void SharedExperts<T>::mlp_backward_fc1(DevPtr<T> ds_x, int64_t n_tok) {
  if (!tp_.active()) return mlp_->backward_fc1(ds_x);
  // The input gradient's partial sum goes to the gathered dy's buffer (fc2's half read it).
  mlp_->backward_fc1(full_y_);
  tp_.enter_backward(*ex_, full_y_, ds_x, n_tok * tp_.size(), H_);
}

template <typename T>
void SharedExperts<T>::shared_and_logits(int64_t n) {
  mlp_forward(s_TH_, n);
  ops::linear_forward(*ex_, l_T_, x_TH_, gate_->compute_as<T>(), n, 1, H_);
}

template <typename T>
void SharedExperts<T>::compute(DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH, int64_t n_tok) {
  compute_fc1(x_TH, x_mlp_TH, n_tok);
  compute_fc2();
}

template <typename T>
void SharedExperts<T>::compute_fc1(DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH,
                                   int64_t n_tok) {
  n_tok_ = n_tok;
  x_TH_ = x_TH;
  x_mlp_TH_ = x_mlp_TH;
  // The gate logits first (Megatron's pre_forward_comm): they read only x, into their own buffer.
  if (gated()) ops::linear_forward(*ex_, l_T_, x_TH_, gate_->compute_as<T>(), n_tok, 1, H_);
  mlp_forward_fc1(n_tok);
}

template <typename T>
void SharedExperts<T>::compute_fc2() {
  mlp_forward_fc2(s_TH_, n_tok_);
}

template <typename T>
void SharedExperts<T>::add_output(DevPtr<T> y_TH) {
  if (!gated()) return ops::add(*ex_, y_TH, y_TH, s_TH_, n_tok_ * H_);
  ops::sigmoid_gate_forward(*ex_, y_TH, s_TH_, l_T_, n_tok_, H_);
}

template <typename T>
void SharedExperts<T>::forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, DevPtr<const T> x_mlp_TH,
                               int64_t n_tok) {
  compute(x_TH, x_mlp_TH, n_tok);
  add_output(y_TH);
}

template <typename T>
void SharedExperts<T>::backward_compute(DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH) {
  backward_fc2(dy_TH, dy_mlp_TH);
  backward_fc1();
}

template <typename T>
void SharedExperts<T>::backward_fc2(DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH) {
  const int64_t n = n_tok_, H = H_;
  if (!gated()) return mlp_backward_fc2(dy_mlp_TH, n);
  if (rerun_) shared_and_logits(n);  // the forward's arithmetic again: the same bits
  ops::sigmoid_gate_backward(*ex_, ds_TH_, dl_T_, dy_TH, s_TH_, l_T_, n, H);
  mlp_backward_fc2(ds_TH_, n);
}

template <typename T>
void SharedExperts<T>::backward_fc1() {
  mlp_backward_fc1(s_TH_, n_tok_);  // s is spent: it takes the MLP's input gradient
}

template <typename T>
void SharedExperts<T>::add_input_grad(DevPtr<T> dx_TH) {
  const int64_t n = n_tok_, H = H_;
  if (gated()) {
    // dx += dl w_g (the gate's input gradient), dw_g += dl^T x.
    ops::linear_backward(*ex_, dx_TH, gate_->grad_as<T>(), dl_T_, x_TH_, gate_->compute_as<T>(), n,
                         1, H, /*accumulate_dx=*/true);
  }
  ops::add(*ex_, dx_TH, dx_TH, s_TH_, n * H);
}

template <typename T>
void SharedExperts<T>::backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, DevPtr<const T> dy_mlp_TH) {
  backward_compute(dy_TH, dy_mlp_TH);
  add_input_grad(dx_TH);
}

template class SharedExperts<float>;
template class SharedExperts<double>;

}  // namespace moecore::moe
