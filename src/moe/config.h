// MoE configuration (Megatron's --moe-* flags): the router's, the MoE layer's, and what a MoE
// layer needs of the model around it (MoeLayerConfig), so src/moe/ depends on nothing in
// src/model/. Validated by the component that owns each struct.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nn/recompute.h"
#include "ops/activation.h"

namespace moecore {

enum class ScoreFunction : uint8_t { Softmax, Sigmoid, SqrtSoftplus };
// --moe-router-load-balancing-type values. The three aux-loss types add a loss; sinkhorn and
// quantile_balancing change the selection instead (docs/router.md).
enum class LoadBalancing : uint8_t {
  None,
  AuxLoss,
  SeqAuxLoss,
  GlobalAuxLoss,
  Sinkhorn,
  QuantileBalancing
};
enum class RouterDType : uint8_t { F32, F64 };
enum class TokenDropPolicy : uint8_t { Probs, Position };
// --moe-token-dispatcher-type (docs/parallel.md, "Expert parallelism"). Both give the same
// model; on one EP rank neither communicates. Megatron's `flex` is not implemented yet.
enum class DispatcherType : uint8_t { AllGather, AlltoAll };
// Routing replay (moe/routing_replay.h): the training forwards record their routing, or route to
// recorded experts.
enum class RoutingReplayMode : uint8_t { Off, Record, Replay };

struct LoadBalancingTerm {
  LoadBalancing type = LoadBalancing::None;
  double coeff = 0.0;  // its --moe-aux-loss-coeff entry
};

const char* load_balancing_name(LoadBalancing lb);  // Megatron's spelling, e.g. "seq_aux_loss"
const char* score_function_name(ScoreFunction s);
const char* dispatcher_type_name(DispatcherType d);  // "allgather", "alltoall"

// Megatron's get_capacity(T * K, E, cf): ceil(T * K / E * cf), evaluated in double as Python does.
int64_t expert_capacity(int64_t n_tok, int64_t topk, int64_t num_experts, double capacity_factor);

struct RouterConfig {
  int64_t num_experts = 8;                            // E
  int64_t topk = 2;                                   // K
  ScoreFunction score = ScoreFunction::Softmax;       // --moe-router-score-function
  bool pre_softmax = false;                           // --moe-router-pre-softmax
  double topk_scaling_factor = 1.0;                   // --moe-router-topk-scaling-factor
  // --moe-router-load-balancing-type / --moe-aux-loss-coeff are parallel lists in Megatron:
  // the first entry lives here, further entries in extra_load_balancing.
  LoadBalancing load_balancing = LoadBalancing::AuxLoss;
  double aux_loss_coeff = 0.0;
  std::vector<LoadBalancingTerm> extra_load_balancing;
  double z_loss_coeff = 0.0;                          // --moe-z-loss-coeff
  RouterDType dtype = RouterDType::F32;               // --moe-router-dtype
  double input_jitter_eps = 0.0;                      // --moe-input-jitter-eps (0: off)
  int64_t num_groups = 0;                             // --moe-router-num-groups (0: off)
  int64_t group_topk = 0;                             // --moe-router-group-topk (0: off)
  bool enable_expert_bias = false;                    // --moe-router-enable-expert-bias
  double bias_update_rate = 1e-3;                     // --moe-router-bias-update-rate
  double quantile_ema = 0.0;                          // --moe-router-quantile-balancing-ema
  double capacity_factor = 0.0;                       // --moe-expert-capacity-factor (<= 0: dropless)
  TokenDropPolicy drop_policy = TokenDropPolicy::Probs;  // --moe-token-drop-policy
  bool pad_to_capacity = false;                       // --moe-pad-expert-input-to-capacity
  // --moe-aux-loss-megatron-map: the aux-loss counts come from the plain top-k of the aux
  // scores, ignoring group limits, expert bias and quantile offsets (Megatron issue #2767).
  bool megatron_aux_map = false;
  uint64_t seed = 0;  // input-jitter stream; the model sets it from --seed
  // The tokens of a forward as this many equal contiguous groups, each keeping its own
  // capacity(T / groups) per expert (no flag; 1: the whole micro-batch). Megatron computes the
  // capacity per rank from the tokens the rank routes, which under attention TP is its sequence
  // slice, the contiguous tokens [r T / TP, (r + 1) T / TP): a one-rank model with TP groups
  // routes as the TP layout does (the layout tests' reference; docs/router.md, "Capacity").
  int64_t capacity_groups = 1;

  // Every (type, coeff) of the lists, in order.
  std::vector<LoadBalancingTerm> load_balancing_terms() const;
  bool uses(LoadBalancing type) const;
  double coeff(LoadBalancing type) const;  // 0 when the type is not listed
  bool group_limited() const { return group_topk > 0; }
  bool dropless() const { return capacity_factor <= 0; }
  int64_t capacity(int64_t n_tok) const {
    return expert_capacity(n_tok, topk, num_experts, capacity_factor);
  }
  void validate() const;
};

struct MoeConfig {
  RouterConfig router;
  int64_t ffn_hidden = 0;         // --moe-ffn-hidden-size (F per expert)
  int64_t shared_ffn_hidden = 0;  // --moe-shared-expert-intermediate-size (0: none)
  // --moe-shared-expert-gate: the shared expert's output times sigmoid(x w_g) per token.
  bool shared_expert_gate = false;
  DispatcherType dispatcher_type = DispatcherType::AlltoAll;  // --moe-token-dispatcher-type
  // --moe-shared-expert-overlap: the shared expert computed while the alltoall dispatcher's
  // all-to-alls are in flight (moe_layer.h); bitwise the same results. Refused with the
  // allgather dispatcher when there is a shared expert (as Megatron does); without a shared
  // expert, or with no all-to-all between ranks (EP 1), it changes nothing.
  bool shared_expert_overlap = false;
  // --moe-expert-rank-capacity-factor (0: unset): under EP, an EP rank's dispatch and expert
  // buffers hold factor x its balanced rows (T x K) instead of the dropless worst case EP x T x K;
  // a step that routes more to one rank stops with an error (moe/dispatcher.h, EpRowBudget).
  double expert_rank_capacity_factor = 0.0;
  // Set by the trainer from its routing replay (train::TrainConfig::routing_replay); no flag.
  RoutingReplayMode routing_replay = RoutingReplayMode::Off;

  // The shared-expert and dispatcher fields (the router validates its own config).
  void validate() const;
};

// What one MoE layer needs of the model it sits in (ModelConfig::moe_layer() makes it).
struct MoeLayerConfig {
  int64_t hidden = 64;            // H
  int64_t num_experts = 8;        // E (all experts, over every EP rank)
  int64_t seq_length = 64;        // whole sequences, for seq_aux_loss
  double init_std = 0.02;         // --init-method-std
  double output_init_std = 0.02;  // the output projections' (fc2): init_std / sqrt(2 L)
  MoeConfig moe;
  RecomputeModules recompute;     // the selective recomputation modules in effect
  ops::Activation activation = ops::Activation::SwiGLU;  // experts' and shared expert's
  bool add_mlp_bias = false;      // fc1 / fc2 biases of the experts and the shared expert
};

}  // namespace moecore
