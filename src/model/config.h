// Model configuration: small structs per component, validated at construction by the component
// that owns them (ModelConfig::validate checks the whole before anything is allocated).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
  DispatcherType dispatcher_type = DispatcherType::AlltoAll;  // --moe-token-dispatcher-type
};

// Activation recomputation (Megatron's --recompute-* flags; docs/design.md, "Memory").
// selective: the listed modules of every layer drop their saved activations after the forward
// and recompute them in the backward. full: whole layers are recomputed from their input;
// uniform splits the layers into chunks of num_layers and keeps only each chunk's input, block
// recomputes the first num_layers layers one by one and keeps the rest. Recomputation
// repeats the forward's arithmetic exactly: losses and gradients are bitwise unchanged.
enum class RecomputeGranularity : uint8_t { None, Selective, Full };
enum class RecomputeMethod : uint8_t { None, Uniform, Block };

struct RecomputeModules {
  bool core_attn = false;       // the attention core (out and lse) from q, k, v
  bool layernorm = false;       // the outputs of input_layernorm and pre_mlp_layernorm
  bool moe_act = false;         // the routed experts' SwiGLU output from fc1's output
  bool moe = false;             // the whole MoE layer (router, dispatch, experts, shared)
  bool shared_experts = false;  // the shared expert's fc1 output and activation
  bool mlp = false;             // a dense layer's MLP (fc1 output and activation)
};

struct RecomputeConfig {
  RecomputeGranularity granularity = RecomputeGranularity::None;
  RecomputeMethod method = RecomputeMethod::None;  // --recompute-method (full only)
  int64_t num_layers = 0;                           // --recompute-num-layers (full only)
  // --recompute-modules (selective only); Megatron's default is core_attn.
  std::vector<std::string> module_names = {"core_attn"};

  bool selective() const { return granularity == RecomputeGranularity::Selective; }
  bool full() const { return granularity == RecomputeGranularity::Full; }
  // The modules in effect (all false unless selective).
  RecomputeModules modules() const;
  // Full recomputation: the chunk a layer is recomputed with (-1: its activations are kept).
  // Layers of one chunk are recomputed together from the chunk's input.
  int64_t chunk_of(int64_t layer) const;
  void validate(int64_t model_layers) const;
};

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t hidden = 64;            // H
  int64_t num_layers = 2;
  int64_t num_heads = 4;          // query heads
  int64_t num_query_groups = 4;   // KV heads (GQA); = num_heads without --group-query-attention
  int64_t kv_channels = 0;        // head dim D (0: hidden / num_heads)
  int64_t ffn_hidden = 256;       // dense MLP width
  int64_t seq_length = 64;
  int64_t max_position_embeddings = 0;  // 0: seq_length
  double rotary_base = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  bool add_qkv_bias = false;      // --add-qkv-bias
  bool qk_layernorm = false;      // --qk-layernorm (RMSNorm over the head dim of q and k)
  bool tie_embeddings = true;     // false with --untie-embeddings-and-output-weights
  // --bf16: GEMMs take bf16 inputs (bf16 copies of the fp32 master weights, activations cast
  // on the way in) and accumulate in f32; router, softmax, norms, losses stay f32.
  bool bf16 = false;
  int64_t num_experts = 0;        // 0: every FFN is a dense MLP
  std::vector<int> moe_layer_pattern;  // one 0/1 per layer; empty: every layer MoE if experts > 0
  MoeConfig moe;
  RecomputeConfig recompute;

  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden / num_heads; }
  int64_t max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  // Megatron scales the init of output projections (attention proj, fc2) by 1/sqrt(2 L).
  double output_init_std() const;
  bool is_moe_layer(int64_t layer) const;
  // Whether any layer has a dense MLP (not every layer is MoE).
  bool has_dense_layer() const;
  void validate() const;
};

// --moe-layer-freq: an integer N (layer i is MoE iff i % N == 0) or a Python-like list
// expression such as "([0]*3+[1]*58)" or "[1,0,1,0]".
std::vector<int> parse_moe_layer_freq(const std::string& spec, int64_t num_layers);

}  // namespace moecore
