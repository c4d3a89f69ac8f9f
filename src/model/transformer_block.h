// A pre-norm transformer block: x1 = x + dropout(attn(norm1(x))); y = x1 + dropout(ffn(norm2(x1))),
// where the FFN is a MoE layer or a dense MLP (--moe-layer-freq decides per layer), the norms
// RMSNorm or LayerNorm, and the hidden dropout (training forwards only) a pure function of the
// micro-batch's counters and each element's global indices (ops/dropout.h).
// Tensor parallelism: the residual stream, the norms and the hidden dropout hold
// tp.local_tokens(T) tokens (this rank's sequence slice with --sequence-parallel, all T
// without); attention and a dense MLP are TP regions (parallel/tensor_parallel.h). The MoE layer
// always takes this rank's sequence slice (T / tp tokens) when tp > 1: without SP the block
// hands it the slice of the whole stream and all-gathers its output over TP.
// With ModelConfig::multi_latent_attention the attention is MLA (model/mla_attention.h), a TP
// region of its own kind: its latents enter it instead of the block's normed input.
// Legend: T tokens, H hidden.
#pragma once

#include <memory>
#include <string>

#include "model/attention.h"
#include "model/config.h"
#include "model/mla_attention.h"
#include "moe/moe_layer.h"
#include "nn/mlp.h"
#include "nn/norm.h"
#include "ops/dropout.h"
#include "parallel/context_parallel.h"

namespace moecore::model {

// Where a block sits in the model: the prefix of its parameters' and random streams' names, its
// member of the arena's per-layer overlay, its FFN's kind and its full-recomputation chunk.
struct BlockSite {
  std::string prefix;
  int64_t member = 0;
  bool moe = false;
  int64_t recompute_chunk = -1;  // -1: its activations are kept
  // Decoder layer l: "decoder.layers.{l}", member l, its own kind and chunk.
  static BlockSite decoder(const ModelConfig& cfg, int64_t layer);
  // Multi-token prediction depth j's layer (model/mtp_layer.h): "mtp.layers.{j}.transformer_layer",
  // member L + j (past the decoder's: its own dropout and jitter streams by name), the last
  // decoder layer's kind, never fully recomputed (Megatron's block method skips the MTP layers).
  static BlockSite mtp(const ModelConfig& cfg, int64_t depth);
};

// The model's norms (input, pre-MLP, final, MTP's): RMSNorm or LayerNorm over the hidden size.
nn::NormConfig norm_config(const ModelConfig& cfg);

template <typename T>
class TransformerBlock {
 public:
  // groups: null = one rank; the attention and dense MLP take the TP group from it, the MoE
  // layer its groups.
  // seed: the dropout streams' (--seed).
  // mla_rope: the rotary tables of multi-latent attention (cfg.multi_latent_attention; built
  // by GPTModel), filled before allocate().
  TransformerBlock(const ModelConfig& cfg, int64_t layer, ParamRegistry& params,
                   const ops::RopeCache& rope, const parallel::ProcessGroups* groups = nullptr,
                   uint64_t seed = 0, const ops::RopeMlaCache* mla_rope = nullptr)
      : TransformerBlock(cfg, BlockSite::decoder(cfg, layer), params, rope, groups, seed,
                         mla_rope) {}
  TransformerBlock(const ModelConfig& cfg, const BlockSite& site, ParamRegistry& params,
                   const ops::RopeCache& rope, const parallel::ProcessGroups* groups = nullptr,
                   uint64_t seed = 0, const ops::RopeMlaCache* mla_rope = nullptr);
  // The layer's workspace and recomputed activations go to member `layer` of the arena's
  // "layer" overlay: they are live only while this layer runs. Under full recomputation its
  // activations go to the "recompute" overlay's member of its chunk instead of being kept.
  // S, B: the micro-batch's sequence on this rank and batch (S * B = T): the whole sequence, or
  // under context parallelism this CP rank's S/cp positions (two chunks of the load-balanced
  // split, parallel/context_split.h).
  void allocate(Arena& arena, int64_t S, int64_t B);
  // x, y: [tp.local_tokens(T), H]. recompute: the backward's rerun of this layer's forward (full
  // recomputation).
  void forward(DevPtr<T> y_TH, DevPtr<const T> x_TH, bool recompute = false);
  // dx assigned (dx may alias dy: the residual stream gradient is updated in place).
  void backward(DevPtr<T> dx_TH, DevPtr<const T> dy_TH, double loss_grad_scale);

  // The micro-batch's dropout counters, read by the next forward (and its recomputation and
  // backward); training off: no dropout.
  void set_dropout_counters(DevPtr<const ops::DropoutCounters> c) { counters_ = c; }
  // Routing replay (MoE layers; moe/routing_replay.h): the micro-batch's table of this layer,
  // [B, S, K] over the whole sequences (every position, before the CP split), which the next
  // training forwards (their recomputations included) route from (replay) or write their
  // tokens' experts to (record). Null: neither.
  void set_routing_table(DevPtr<int32_t> table_BSK) { routing_table_ = table_BSK; }
  void set_training(bool training);

  // --bf16 without --fp32-residual-connection (ModelConfig::bf16_residual, T = float): the
  // stream's values are bf16 (each residual add's output rounded once) and the block keeps x1
  // as bf16 alone (its f32 form lives in the output y until the second add overwrites it).
  // keep_input_bf16(input): called before allocate() by an owner whose input buffer `input`
  // (every forward's x) is not kept for the backward (GPTModel's stream between layers): the
  // block keeps its own bf16 copy of x (exact: x holds bf16 values) and, in its backward,
  // widens it into `input`, which the owner leaves to the block then.
  bool bf16_residual() const { return round_resid_; }
  // kept: the block starts a fully recomputed chunk; its bf16 copy is then kept (not
  // recomputed) and restore_input() widens it into `input` before the chunk's recomputation.
  void keep_input_bf16(DevPtr<T> input, bool kept = false) {
    keep_x16_ = round_resid_;
    x_scratch_ = input;
    input_kept_ = kept;
  }
  void restore_input();

  bool is_moe() const { return moe_ != nullptr; }
  int64_t member() const { return member_; }  // BlockSite::member
  const moe::MoELayer<T>* moe() const { return moe_.get(); }
  moe::MoELayer<T>* moe() { return moe_.get(); }

 private:
  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  // y = residual + dropout(branch) (the plain sum without dropout).
  void residual_add(DevPtr<T> y, DevPtr<const T> residual, DevPtr<const T> branch, uint64_t key);
  // bf16 residual: y rounded to bf16 values in place (else nothing), and a kept bf16 copy
  // widened into y.
  void round_stream(DevPtr<T> y);
  void widen_kept(DevPtr<T> y, DevPtr<const bf16> x16);
  bool dropping() const { return training_ && hidden_p_ > 0; }
  // --bf16: n1 into its bf16 copy after the norm; back into n1_ before the attention's backward.
  void store_n1();
  void load_n1();
  // The bf16 residual: n2 into its bf16 copy after the norm; back into n2_ (dn_) before the
  // FFN's backward.
  void store_n2();
  void load_n2();

  // The MoE layer's input (moe_in) and output: its slice of the stream without SP.
  void moe_forward(DevPtr<const T> x, bool recompute);
  // Routing replay: the MoE layer's tokens' rows of the table into the router's replayed
  // experts before the forward (replay), or its experts into the table after it (record).
  void replay_routing(bool after_forward);
  void moe_backward(DevPtr<T> dx, DevPtr<const T> dy, double loss_grad_scale);
  // The dense MLP as a TP region: y (local tokens) from x (local tokens).
  void mlp_forward(DevPtr<T> y, DevPtr<const T> x);
  void mlp_backward(DevPtr<T> dx, DevPtr<const T> dy);

  // The hidden dropout of rows [S_loc_) from s0_ (local rows): one call per run of consecutive
  // global positions (two runs where the rows cross from a CP rank's early chunk to its mirror).
  template <typename F>
  void for_each_dropout_run(F&& f) const;

  parallel::TensorParallel tp_;  // the attention grid's TP group
  parallel::ContextParallel cp_;  // the attention grid's CP group, this layer's comm type
  // member_: the arena overlay's (BlockSite). n_tok_: the micro-batch's T; n_loc_: the tokens
  // held here (tp.local_tokens(T)); S_loc_: their sequence positions, from local row s0_ (global
  // positions: cp_'s split of S_ * cp).
  int64_t member_, H_, S_ = 0, B_ = 0, n_tok_ = 0, n_loc_ = 0, S_loc_ = 0, s0_ = 0;
  double hidden_p_;
  uint64_t key_attn_out_, key_ffn_out_;  // the two hidden-dropout sites' streams
  ops::AttentionDropout attn_drop_;
  DevPtr<const ops::DropoutCounters> counters_ = nullptr;
  DevPtr<int32_t> routing_table_ = nullptr;  // set_routing_table's
  bool training_ = true;
  int64_t recompute_chunk_;  // full recomputation: this layer's chunk (-1: kept)
  bool recompute_norms_;     // selective "layernorm": n1 and n2 recomputed in the backward
  bool recompute_mlp_;       // selective "mlp": a dense FFN recomputes fc1 and activation
  bool round_n1_ = false;    // n1 / n2 written as bf16 values (they feed only bf16 GEMMs, or
                             // n2 is a bf16 tensor: the bf16 residual)
  bool round_n2_ = false;
  bool round_resid_ = false;  // bf16_residual()
  bool keep_x16_ = false;     // keep_input_bf16()
  bool input_kept_ = false;
  nn::Norm<T> norm1_;
  nn::Norm<T> norm2_;
  // One of the two: the QKV self-attention, or multi-latent attention.
  std::unique_ptr<SelfAttention<T>> attn_;
  std::unique_ptr<MlaAttention<T>> mla_;
  std::unique_ptr<moe::MoELayer<T>> moe_;
  std::unique_ptr<nn::MLP<T>> mlp_;
  DevPtr<const T> x_TH_ = nullptr;
  // n1 feeds only the attention's bf16 GEMMs under --bf16 (T = float; QKV or MLA's down
  // projections): it is kept for the
  // backward in bf16 (n1_16_, Megatron-Core's bf16 norm output), n1_ then the transient f32
  // workspace the attention reads (its values rounded to bf16), refilled from n1_16_ before
  // the attention's backward. Null without --bf16 or when n1 is recomputed.
  DevPtr<bf16> n1_16_ = nullptr;
  DevPtr<T> n1_ = nullptr;
  DevPtr<T> x1_ = nullptr;  // null with the bf16 residual (x1 in y, then in dx1_)
  // bf16 residual: the kept bf16 copies of x1 and (keep_input_bf16) of the input x, and the
  // owner's input buffer that the backward widens x16_ into.
  DevPtr<bf16> x1_16_ = nullptr;
  DevPtr<bf16> x16_ = nullptr;
  DevPtr<T> x_scratch_ = nullptr;
  // n2, the FFN's input: with the bf16 residual rounded to bf16 and kept as bf16 alone (n2_16_,
  // Megatron-Core's bf16 hidden states entering the MoE layer or MLP; planned as recomputed and
  // left unwritten when the "layernorm" recomputation recomputes n2), n2_ then dn_, the layer's
  // workspace that is free in the forward and in the backward until norm2's.
  DevPtr<bf16> n2_16_ = nullptr;
  DevPtr<T> n2_ = nullptr;
  DevPtr<T> branch_ = nullptr;  // attention / FFN output, then gradients
  DevPtr<T> dn_ = nullptr;
  DevPtr<T> dx1_ = nullptr;
  // TP > 1 (null otherwise). With SP: the dense MLP's gathered input (gathered again in the
  // backward) and its partial output / gradients, [T, H]. MoE without SP: the MoE layer's
  // output and input gradient on this rank's slice, [T / tp, H].
  DevPtr<T> full_x_ = nullptr;
  DevPtr<T> full_y_ = nullptr;
  DevPtr<bf16> mlp_wire16_ = nullptr;  // --bf16 + SP: the bf16 staging of full_x_'s all-gather
  DevPtr<T> moe_slice_ = nullptr;
};

}  // namespace moecore::model
