// The GPT model: embedding -> transformer blocks -> final RMSNorm -> untied output head fused
// with cross entropy. Owns the parameter registry and the arena; all memory (parameters,
// gradients, activations, workspace) is planned for one micro-batch shape before step 0.
// Legend: S sequence, B micro-batch, T = S*B tokens (sequence-major), H hidden, V vocab.
#pragma once

#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/param_registry.h"
#include "model/config.h"
#include "model/transformer_block.h"
#include "ops/cross_entropy.h"
#include "ops/rope.h"

namespace moecore::model {

// Per-step router statistics summed over MoE layers (the logged values average them).
struct MoeStats {
  int64_t num_moe_layers = 0;
  double aux_value = 0;  // sum over layers of the coefficient-free aux loss
  double aux_loss = 0;   // sum of coeff * aux
  double z_loss = 0;     // sum of coeff_z * mean(lse^2)
  std::vector<int64_t> tokens_per_expert;  // summed over layers, [E]
};

template <typename T>
class GPTModel {
 public:
  GPTModel(const ModelConfig& cfg, int64_t micro_batch, uint64_t seed);

  // ids, targets [B, S] (batch-major as a data loader yields them); targets < 0 are ignored.
  // Returns the mean cross entropy over the counted tokens.
  double forward(const int32_t* ids_BS, const int32_t* targets_BS);
  // Accumulates parameter gradients of loss_grad_scale * (mean CE + aux + z losses).
  void backward(double loss_grad_scale);

  MoeStats moe_stats() const;
  ParamRegistry& params() { return params_; }
  const ParamRegistry& params() const { return params_; }
  const Arena& arena() const { return arena_; }
  const ModelConfig& config() const { return cfg_; }
  int64_t micro_batch() const { return B_; }

 private:
  void allocate(Arena& a);

  ModelConfig cfg_;
  int64_t S_, B_, T_;
  ParamRegistry params_;
  Arena arena_;
  ops::RopeCache rope_;
  Param* embedding_;
  Param* final_norm_;
  Param* head_;
  std::vector<std::unique_ptr<TransformerBlock<T>>> blocks_;
  ops::HeadLossShape head_shape_;
  int32_t* ids_T_ = nullptr;
  int32_t* targets_T_ = nullptr;
  int64_t counted_ = 0;
  std::vector<T*> stream_;  // residual stream at each layer boundary, [L + 1] x [T, H]
  T* final_n_ = nullptr;
  T* final_rstd_ = nullptr;
  T* loss_T_ = nullptr;
  T* lse_T_ = nullptr;
  T* head_ws_ = nullptr;
  T* dstream_ = nullptr;
  T* dfinal_ = nullptr;
};

}  // namespace moecore::model
