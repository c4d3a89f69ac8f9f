// Model configuration: the dense model's sizes and options; the MoE part is moe/config.h and
// recomputation nn/recompute.h. Each struct is validated by the component that owns it
// (ModelConfig::validate checks the whole before anything is allocated).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/config.h"
#include "nn/recompute.h"
#include "ops/activation.h"
#include "ops/rope_mla.h"
#include "ops/rope_yarn.h"

namespace moecore {

// --normalization: Megatron's default LayerNorm (weight and bias) or RMSNorm (weight only).
enum class Normalization : uint8_t { LayerNorm, RMSNorm };
// --position-embedding-type: Megatron's default learned_absolute (a [max positions, H] table
// added to the word embedding), rope, or none.
enum class PositionEmbedding : uint8_t { LearnedAbsolute, Rope, None };

// Multi-latent attention's sizes and rotary (Megatron's MLATransformerConfig; read only with
// ModelConfig::multi_latent_attention). Queries: x -> linear_q_down_proj [q_lora_rank] -> RMSNorm
// -> linear_q_up_proj [heads x (qk_head_dim + qk_pos_emb_head_dim)], or with q_lora_rank 0
// (Megatron's None) one linear_q_proj; keys and values: x -> linear_kv_down_proj [kv_lora_rank +
// qk_pos_emb_head_dim], the latent part RMS-normed -> linear_kv_up_proj [heads x (qk_head_dim +
// v_head_dim)], the last qk_pos_emb_head_dim rotated once and shared by every head.
struct MlaConfig {
  int64_t q_lora_rank = 0;           // --q-lora-rank (0: None, a direct q projection)
  int64_t kv_lora_rank = 32;         // --kv-lora-rank
  int64_t qk_head_dim = 128;         // --qk-head-dim: the un-rotated part of q and k
  int64_t qk_pos_emb_head_dim = 64;  // --qk-pos-emb-head-dim: the rotated part
  int64_t v_head_dim = 128;          // --v-head-dim
  // --rope-type: Megatron's None takes yarn for MLA (its help text); the CLI resolves it.
  ops::RopeType rope_type = ops::RopeType::Yarn;
  // --rotary-scaling-factor, --mscale, --mscale-all-dim (Megatron's flags, defaults 1, 1, 0) and
  // --yarn-original-max-position-embeddings, --yarn-beta-fast, --yarn-beta-slow (Megatron's
  // MLATransformerConfig values 4096, 32, 1 when not given).
  ops::YarnParams yarn;

  int64_t q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
  // MultiLatentAttention's softmax_scale: m^2 / sqrt(q_head_dim), m = yarn_get_mscale(factor,
  // mscale_all_dim), whatever the rope type (m = 1 at factor 1).
  double softmax_scale() const {
    return ops::mla_softmax_scale(qk_head_dim, qk_pos_emb_head_dim, yarn.scaling_factor,
                                  yarn.mscale_all_dim);
  }
  // The rotary tables' spec: interleaved pairs (Megatron's MLA and HF's rope_interleave).
  ops::RopeMlaSpec rope_spec(double rotary_base) const {
    return ops::RopeMlaSpec{qk_pos_emb_head_dim, rotary_base, ops::RopePairing::Interleaved,
                            ops::RopeScaling{rope_type, yarn}};
  }
  void validate() const;
};

struct ModelConfig {
  // The model's vocabulary V: the token ids and targets are below it, the softmax, the loss and
  // the logits (forward_logits, eval, export) cover exactly these tokens.
  int64_t vocab_size = 256;
  // The rows of the embedding table and the output head, Vp >= V (0: V): the vocabulary padded
  // to a multiple of --make-vocab-size-divisible-by x TP so that every TP rank holds an equal
  // slice of Vp / tp rows. The rows past V are padding, not model: initialised to zero, never
  // read, never given a gradient (ParamSpec::model_rows), so every padding trains the same
  // model. Unlike Megatron, whose padded logits take part in the softmax.
  int64_t padded_vocab_size = 0;
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
  Normalization normalization = Normalization::RMSNorm;
  bool layernorm_1p = false;  // --apply-layernorm-1p: LayerNorm's weight stored as gamma - 1
  PositionEmbedding position_embedding = PositionEmbedding::Rope;
  ops::Activation activation = ops::Activation::SwiGLU;  // dense MLPs, experts, shared expert
  // Biases of the MLPs' fc1 and fc2 (dense, experts, shared expert); Megatron's
  // --add-bias-linear (its default) also sets add_qkv_bias and add_attention_output_bias.
  bool add_mlp_bias = false;
  // --hidden-dropout (after attention and after the MLP / MoE, and on the embeddings) and
  // --attention-dropout (on the attention probabilities): training forwards only.
  double hidden_dropout = 0.0;
  double attention_dropout = 0.0;
  double init_std = 0.02;
  bool add_qkv_bias = false;      // --add-qkv-bias
  // --add-attention-output-bias (moecore's flag): a bias after the attention output projection,
  // linear_proj.bias, as HuggingFace configs with attention_bias have (Megatron's
  // --add-bias-linear gives it to every linear layer).
  bool add_attention_output_bias = false;
  bool qk_layernorm = false;      // --qk-layernorm (RMSNorm over the head dim of q and k)
  // --multi-latent-attention: MLA (MlaConfig) instead of the QKV self-attention. With it
  // --qk-layernorm gives MLA's q_layernorm and kv_layernorm (Megatron's layer spec; without it
  // they are identities) and kv_channels / num_query_groups are not read.
  bool multi_latent_attention = false;
  MlaConfig mla;
  bool tie_embeddings = true;     // false with --untie-embeddings-and-output-weights
  // --bf16 (Megatron's bf16 parameters): every layer reads the bf16 values of the fp32 master
  // weights; GEMMs take bf16 inputs (activations cast on the way in) and accumulate in f32;
  // router, softmax, norms and losses compute in f32 on those bf16 weight values.
  bool bf16 = false;
  // --fp32-residual-connection: under --bf16 the residual stream stays f32 (Megatron's flag).
  // Without it (the default) --bf16 keeps the stream in bf16 as Megatron-Core does: the
  // embedding's output and each residual add's are rounded to bf16, and the copies kept for the
  // norms' backwards are bf16 (bf16_residual()).
  bool fp32_residual_connection = false;
  bool bf16_residual() const { return bf16 && !fp32_residual_connection; }
  // --bf16 with the distributed optimizer sharding over more than one rank: the fp32 master
  // weights exist only in the optimizer's shards (Megatron's 6 + 12/d bytes per parameter); the
  // model holds the bf16 values alone. Set by the trainer and the planner, not a flag.
  bool master_weights_sharded = false;
  // Multi-token prediction (DeepSeek-V3's, Megatron's --mtp-num-layers D, 0 for its None): D
  // extra depths after the decoder's final norm, each predicting one token further ahead
  // (model/mtp_layer.h); their cross entropies, averaged over the depths and times
  // --mtp-loss-scaling-factor, join the loss's gradient.
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  int64_t num_experts = 0;        // 0: every FFN is a dense MLP
  std::vector<int> moe_layer_pattern;  // one 0/1 per layer; empty: every layer MoE if experts > 0
  MoeConfig moe;
  RecomputeConfig recompute;

  int64_t padded_vocab() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }
  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden / num_heads; }
  int64_t max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  // Megatron scales the init of output projections (attention proj, fc2) by 1/sqrt(2 L).
  double output_init_std() const;
  bool is_moe_layer(int64_t layer) const;
  // An MTP depth's transformer layer is of the last decoder layer's kind (Megatron's MTP block
  // spec takes the decoder's last layer spec).
  bool mtp_is_moe() const { return is_moe_layer(num_layers - 1); }
  // Whether any layer has a dense MLP (not every layer is MoE).
  bool has_dense_layer() const;
  // What a MoE layer of this model needs (src/moe/ does not see ModelConfig).
  MoeLayerConfig moe_layer() const;
  void validate() const;
  // A lower bound of the parameters one rank holds with `ep` expert-parallel ranks (the
  // projections and MLP weights only), in closed form: what a size too large for any machine is
  // checked against before the model is built layer by layer.
  double min_params_per_rank(int64_t ep) const;
};

// --moe-layer-freq: an integer N (layer i is MoE iff i % N == 0) or a Python-like list
// expression such as "([0]*3+[1]*58)" or "[1,0,1,0]".
std::vector<int> parse_moe_layer_freq(const std::string& spec, int64_t num_layers);

}  // namespace moecore
