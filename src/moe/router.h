// The router: gating logits, score function, top-k selection, the probabilities the experts
// apply, and the load-balancing (aux) and z losses with their gradients.
// Legend: T tokens, H hidden, E routed experts, K top-k.
#pragma once

#include <cstdint>
#include <string>

#include "core/arena.h"
#include "core/param_registry.h"
#include "model/config.h"

namespace moecore::moe {

template <typename T>
struct RouterSaved {
  const T* x_TH = nullptr;       // router input, owned by the caller until backward
  T* logits_TE = nullptr;        // x W_r^T
  T* scores_TE = nullptr;        // softmax(logits) over E, or sigmoid(logits)
  T* aux_scores_TE = nullptr;    // the aux loss's scores (sigmoid: s / (sum_E s + 1e-20))
  T* topv_TK = nullptr;          // selected logits (softmax) or scores (pre-softmax, sigmoid)
  int32_t* idx_TK = nullptr;     // chosen experts, descending score
  T* probs_TK = nullptr;         // the weights the experts apply
  int64_t* tokens_per_expert_E = nullptr;
  T* lse_T = nullptr;            // logsumexp(logits), for the z-loss
  int64_t n_tok = 0;
  double aux_value = 0;          // coefficient-free switch loss (exactly 1 for uniform routing)
  double aux_loss = 0;           // aux_loss_coeff * aux_value
  double z_loss = 0;             // z_loss_coeff * mean(lse^2)
};

template <typename T>
class Router {
 public:
  Router(const RouterConfig& cfg, int64_t hidden, double init_std, ParamRegistry& params,
         const std::string& prefix);

  void allocate(Arena& arena, int64_t max_tokens);
  void forward(const T* x_TH, int64_t n_tok);
  // dprobs [T, K] -> dW_r (+=) and dx (+=: the router is one branch of the MoE input). The
  // aux and z-loss gradients enter here, multiplied by loss_grad_scale (1 / micro-batches).
  void backward(T* dx_TH, const T* dprobs_TK, double loss_grad_scale);

  const RouterSaved<T>& saved() const { return saved_; }
  const RouterConfig& config() const { return cfg_; }
  const Param& weight() const { return *weight_; }

 private:
  RouterConfig cfg_;
  int64_t H_;
  Param* weight_;  // [E, H]
  RouterSaved<T> saved_;
  T* dlogits_TE_ = nullptr;
  T* work_TE_ = nullptr;
  T* work_TK_ = nullptr;
};

}  // namespace moecore::moe
