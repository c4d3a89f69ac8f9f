// The GPT model: embedding -> transformer blocks -> final RMSNorm -> untied output head fused
// with cross entropy, and with --mtp-num-layers the multi-token prediction depths after the final
// norm (model/mtp_block.h) sharing the embedding and the head (their losses: model/mtp_loss.h). Under tensor parallelism (the
// attention grid's TP group) the embedding and the output head are vocab-parallel
// (model/vocab_parallel.h) and the residual stream holds TensorParallel::local_tokens(T) tokens:
// this rank's T/tp with --sequence-parallel. Under context parallelism (the attention grid's cp
// group) the model holds S/cp positions of every sequence, the load-balanced split's two chunks
// (parallel/context_split.h): the attention runs across the cp ranks, positions and dropout are
// the global ones, and the loss is summed over cp. Owns the parameter registry and the arena; all
// memory (parameters, gradients, activations, workspace) is planned for one micro-batch shape
// before step 0. Legend: S this rank's sequence (S/cp of --seq-length), B micro-batch, T = S*B
// tokens (sequence-major), H hidden, V the model's vocabulary, Vp the tables' rows (padded for
// TP: ModelConfig::padded_vocab_size).
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "nn/param_registry.h"
#include "parallel/context_parallel.h"
#include "parallel/pipeline_layout.h"
#include "model/config.h"
#include "model/mtp_block.h"
#include "model/mtp_loss.h"
#include "model/transformer_block.h"
#include "model/vocab_parallel.h"
#include "nn/norm.h"
#include "ops/dropout.h"
#include "ops/cross_entropy.h"
#include "ops/rope.h"
#include "ops/step_report.h"

namespace moecore::parallel {
class ProcessGroups;
}

namespace moecore::model {

// One MoE layer's routing in the last forward, for the logs.
struct MoeLayerStats {
  int64_t layer = 0;
  moe::RouterStats router;  // tokens per expert, max/mean load, dropped, bias / beta range
};

// Router statistics of the last forward summed over MoE layers (the logged values average
// them), plus each layer's own.
struct MoeStats {
  int64_t num_moe_layers = 0;
  double aux_value = 0;  // sum over layers of the coefficient-free aux loss (first listed type)
  double aux_loss = 0;   // sum of coeff * aux over every listed aux type
  double z_loss = 0;     // sum of coeff_z * mean(lse^2)
  double z_value = 0;    // sum of mean(lse^2)
  // Sums over layers of each aux type's coefficient-free value: aux_loss, seq_aux_loss,
  // global_aux_loss (0 for types not listed).
  double lb_value[3] = {0, 0, 0};
  int64_t dropped = 0;            // (token, slot) pairs dropped by capacity, summed over layers
  double max_over_mean_load = 0;  // the worst layer's max/mean expert load
  std::vector<int64_t> tokens_per_expert;  // summed over layers, [E]
  std::vector<MoeLayerStats> layers;
};

// One micro-batch's planned memory: its inputs, token ids and targets [B, S] (batch-major as a
// data loader yields them), which the host writes before the step, and its slot of the step
// report, which the forward's ops write and the host reads once, after the step.
struct MicroBatchIO {
  DevPtr<const int32_t> ids_BS = nullptr;
  DevPtr<const int32_t> targets_BS = nullptr;
  DevPtr<ops::MicroBatchReport> report = nullptr;
  // [E] summed over MoE layers (unused without them).
  DevPtr<int64_t> tokens_per_expert_E = nullptr;
  // Where the micro-batch sits in the run (iteration, first sample in the global batch): the
  // dropout masks' counters. Null: the model's own zeros (tests and tools; eval never drops).
  DevPtr<const ops::DropoutCounters> dropout = nullptr;
  // Multi-token prediction under context parallelism: each depth's ids and targets rolled on the
  // whole sequences before the split, [D, B, S] (S this rank's positions), depth j at j B S.
  // Null: the depths roll the micro-batch's own tokens (one CP rank).
  DevPtr<const int32_t> mtp_ids_BS = nullptr;
  DevPtr<const int32_t> mtp_targets_BS = nullptr;
  // Routing replay (moe/routing_replay.h; ModelConfig's moe.routing_replay not Off): the
  // micro-batch's routing tables, [routing_layers(), B, S, K] int32 over the whole sequences,
  // which the MoE layers' training forwards read (replay) or write (record: their own tokens).
  // Null: neither.
  DevPtr<int32_t> routing_BSK = nullptr;
};

template <typename T>
class GPTModel {
 public:
  // Tokens per chunk of the fused output head + cross entropy (its logits workspace).
  static constexpr int64_t kHeadChunk = 1024;
  // groups: null = one rank. MoE layers hold their EP rank's experts and dispatch over its
  // EP group; the groups must outlive the model.
  // size_only: run the arena's planning pass alone (sizes, no allocation, no initialization):
  // the model then answers arena() and params() sizes and nothing else. `moecore plan` uses it
  // to size a rank of any model without allocating it.
  // ex: the execution context every layer runs its ops on (the arena plans its memory).
  // chunks: the virtual pipeline stages this rank holds, in chunk order (pipeline parallelism:
  // parallel/pipeline_layout.h): their decoder layers (global indices: parameter names,
  // initialization and dropout are the one-rank model's), the embedding on the chunk that has
  // it, the output head and loss on the one that has the loss, the MTP depths (all
  // --mtp-num-layers) where the chunk has them: with the loss, or in a virtual stage before it
  // (Megatron's standalone MTP stage), which sends the decoder's final-normed hidden states and
  // every depth's on, concatenated ((1 + D) boundary activations, split by the loss's stage).
  // The decoder's final norm runs after its last layer's chunk with MTP (Megatron's
  // TransformerBlock.has_final_layernorm_in_this_stage), else on the loss's. Empty: the whole
  // model as one chunk. A rank without the embedding keeps a copy of the table as its tied head
  // and for its MTP depths' embeddings (ParamSpec::pipeline_copy; the same name and values).
  GPTModel(const ModelConfig& cfg, int64_t micro_batch, uint64_t seed,
           const parallel::ProcessGroups* groups = nullptr, bool size_only = false,
           const Exec& ex = cpu_exec(), std::vector<parallel::VirtualStage> chunks = {});

  // ---- pipeline parallelism: one chunk at a time (pipeline/pipeline_runner.h runs them) ----
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  const parallel::VirtualStage& chunk(int c) const { return chunks_[c].stage; }
  // The forward of chunk c for one micro-batch (the whole-model forward() for one chunk):
  // input [T_local, H] is the previous virtual stage's output (null for the chunk with the
  // embedding). microbatch: its index in the step (the routers' jitter stream). replay: the
  // recomputation of that micro-batch's forward right before its backward, when other forwards
  // ran since: the same values, nothing reported, no balancing counts.
  void forward_chunk(int c, const MicroBatchIO& io, DevPtr<const T> input, int64_t microbatch,
                     bool replay = false);
  // Where chunk c's forward takes its input (input_elems(c)): a caller may write the input there
  // itself and pass this buffer as forward_chunk's input (nothing is copied then).
  DevPtr<T> chunk_input(int c) const { return chunks_[c].stream[0]; }
  // Chunk c's output after its forward (not for the chunk with the loss): output_elems(c).
  DevPtr<const T> chunk_output(int c) const { return chunks_[c].output; }
  // The decoder's final-normed output [T_local, H] of the last forward (the head's and the
  // first MTP depth's input), on the rank with the loss.
  DevPtr<const T> final_norm_output() const { return final_n_; }
  // Whether this rank runs the decoder's final norm (the loss's stage, or with MTP the decoder's
  // last layer's).
  bool has_final_norm() const { return final_norm_ != nullptr; }
  // The MTP depths (null without --mtp-num-layers, or on a rank without them).
  const MtpBlock<T>* mtp() const { return mtp_.get(); }
  // The backward of chunk c for the micro-batch of its last forward (or replay): doutput is the
  // gradient of its output (null for the chunk with the loss). The grad-ready hook sees the
  // chunk's stages.
  void backward_chunk(int c, double loss_grad_scale, DevPtr<const T> doutput, int64_t microbatch);
  // The gradient of the chunk's input after backward_chunk (not for the chunk with the
  // embedding): input_elems(c) of the chunk that ran.
  DevPtr<const T> input_grad() const { return dstream_; }
  // Elements of one activation passed between stages: [S (/tp with SP), B, H].
  int64_t boundary_elems() const { return T_local_ * cfg_.hidden; }
  // Elements chunk c receives (its input, and its input's gradient it sends back) and sends
  // (its output, and the gradient it receives): boundary_elems(), times 1 + --mtp-num-layers
  // from the MTP layers' stage on (the decoder's hidden states and every depth's).
  int64_t input_elems(int c) const { return chunks_[c].in_width * boundary_elems(); }
  int64_t output_elems(int c) const { return chunks_[c].out_width * boundary_elems(); }
  // The tied table this rank holds as the embedding or as the last stage's head copy (null:
  // untied, or neither on this rank).
  Param* tied_table() const {
    return cfg_.tie_embeddings ? (embedding_ != nullptr ? embedding_ : head_) : nullptr;
  }
  // The word-embedding table of Megatron's embedding group (the first stage, the MTP layers'
  // and a tied head's: parallel::word_table_ranks), whose gradients the pipeline sums over them:
  // with a tied head or MTP, the embedding on the rank that has it, else this rank's copy (null on
  // other ranks).
  Param* shared_embedding() const {
    if (!cfg_.tie_embeddings && cfg_.mtp_num_layers == 0) return nullptr;
    if (embedding_ != nullptr) return embedding_;
    return cfg_.tie_embeddings && head_ != nullptr ? head_ : mtp_table_;
  }
  // The decoder layers this rank holds, in global order.
  const std::vector<int64_t>& layers() const { return block_layer_; }

  // The step's forward of one micro-batch: reads io's inputs, writes its report slot (the sum of
  // the cross entropy over the counted tokens, the count, each MTP depth's sum and count, the MoE
  // layers' aux and z values, dropped slots and tokens per expert). Targets < 0 are ignored.
  // Nothing returns to the host.
  void forward(const MicroBatchIO& io);
  // The same on host arrays with the model's own report slot, read back at once: the mean cross
  // entropy over the counted tokens (tests and tools; the trainer reads its report after the
  // step).
  double forward(DevPtr<const int32_t> ids_BS, DevPtr<const int32_t> targets_BS);
  // The logits of one micro-batch, forward only: ids [B, S] -> logits_BSV [B, S, V] (batch-major
  // like the ids; V the model's vocabulary: the padding has no logit), through the same embedding,
  // blocks and final norm as forward(), with the output head as a plain GEMM instead of the fused
  // cross entropy (under TP each rank's model rows are broadcast in turn: every TP rank returns
  // the whole logits). The routers run in eval mode for the call (no jitter, no balancing
  // counts) and return to the mode they were in. With --bf16 the blocks round their GEMM inputs as
  // in forward(); this head GEMM takes the f32 master weights. A backward() must follow a
  // forward(), not this.
  void forward_logits(DevPtr<const int32_t> ids_BS, DevPtr<T> logits_BSV);
  // The mean cross entropy of a report slot (0 when no target counts).
  static double mean_loss(const ops::MicroBatchReport& r) {
    return r.counted > 0 ? r.lm_loss_sum / static_cast<double>(r.counted) : 0.0;
  }
  // MTP depth k = j + 1's mean cross entropy in a report slot (0 when no target counts).
  static double mtp_mean_loss(const ops::MicroBatchReport& r, int64_t j) {
    return r.mtp_counted[j] > 0 ? r.mtp_loss_sum[j] / static_cast<double>(r.mtp_counted[j]) : 0.0;
  }
  // The loss whose gradient backward() takes, less the routers' aux and z terms: the mean cross
  // entropy plus (--mtp-loss-scaling-factor / D) x the depths' mean cross entropies.
  double training_loss(const ops::MicroBatchReport& r) const;
  // The model's own report slot (forward(ids, targets)'s), read back: tests and tools.
  ops::MicroBatchReport own_report() const;
  // Accumulates parameter gradients of loss_grad_scale * (training_loss + aux + z losses) of the
  // last forward; 1 / counted tokens is applied from that forward's report slot, in memory.
  // loss_grad_scale is a constant of the layout (1 / (micro-batches x data-parallel size)).
  // After each backward stage (see grad_stages) the grad-ready hook, if set, is called with
  // the stage's index: the data-parallel gradient buckets launch their all-reduces from it.
  void backward(double loss_grad_scale);

  // The backward in stages, in the order it runs: [0] the final norm, an untied output head and
  // the MTP depths, [1 + i] the parameters of block L-1-i, [L + 1] the embedding (with a tied
  // head or MTP it receives its last gradient there). Once backward has finished stage s, the
  // gradients of the parameters of stages <= s are final for this micro-batch. Every parameter is
  // in exactly one stage.
  const std::vector<std::vector<const Param*>>& grad_stages() const { return grad_stages_; }
  void set_grad_ready_hook(std::function<void(int stage)> hook) { grad_ready_ = std::move(hook); }
  // Its forward-order counterpart: every forward (forward(), forward_logits()) calls the
  // params-needed hook, if set, with a stage's index (grad_stages' numbering) just before the
  // first op that reads a parameter of that stage: L + 1 (the embeddings) first, then each
  // block's L - l, then 0 (the final norm, an untied head and the MTP depths). The distributed optimizer's
  // deferred parameter gathers (--overlap-param-gather) complete there.
  void set_params_needed_hook(std::function<void(int stage)> hook) {
    params_needed_ = std::move(hook);
  }

  // Once per optimizer step, after the update: the bf16 weight copies (--bf16) are refreshed
  // from the masters, and every router's expert-bias / quantile update and accumulator reset
  // run. `sync` carries the parallel layout's all-reduces.
  void finish_step(const moe::RouterStepSync& sync = {});
  // Training forwards jitter router inputs and accumulate balancing counts; eval ones do not.
  void set_training(bool training);

  // The routers' reports of the last forward, read on the host (after the step: the per-layer
  // log lines; tests). Fills *out in place: after the first call nothing allocates.
  void moe_stats(MoeStats* out) const;
  MoeStats moe_stats() const {
    MoeStats st;
    moe_stats(&st);
    return st;
  }
  // The routers of the MoE layers in layer order: their balancing state (expert bias, quantile
  // beta) for checks across replicas.
  // The prefixes of this rank's MoE layers ("decoder.layers.3.mlp"), in routers()' order: the
  // order of MicroBatchIO::routing_BSK's tables.
  std::vector<std::string> routing_layers() const;
  std::vector<const moe::Router<T>*> routers() const;
  std::vector<moe::Router<T>*> routers();  // the same, to load their state from a checkpoint
  ParamRegistry& params() { return params_; }
  const ParamRegistry& params() const { return params_; }
  const Arena& arena() const { return arena_; }
  const ModelConfig& config() const { return cfg_; }
  const parallel::ProcessGroups* groups() const { return groups_; }
  int64_t micro_batch() const { return B_; }

 private:
  void allocate(Arena& a);
  void allocate_vocab(Arena& a, Param* table);  // the head's and the tables' buffers
  // forward_chunk's path up to the final norm (final_n_, with the loss): io's inputs to
  // sequence-major, the embedding or the input, the chunk's blocks (the MoE layers' results
  // summed into io's report slot unless replaying).
  void forward_trunk(int c, const MicroBatchIO& io, DevPtr<const T> input, int64_t microbatch,
                     bool replay);
  void set_replay_micro_batch(int c, int64_t microbatch);
  // Block b's table in io.routing_BSK (null without one, or when b has no MoE layer).
  DevPtr<int32_t> routing_table(const MicroBatchIO& io, const TransformerBlock<T>& b) const;
  // Each MoE block's slot in MicroBatchIO::routing_BSK (routers()' order), set once the blocks
  // are listed in all_blocks_.
  void routing_slots();
  std::unordered_map<const TransformerBlock<T>*, int64_t> routing_slot_;
  // x_local [T_local, H] = dropout(table[ids_T] (+ positions[pos_T])) with the dropout stream
  // `key` (the embedding's, or an MTP depth's), and its backward (dx_local overwritten).
  void embed(const Param& table, DevPtr<T> x_local, DevPtr<const int32_t> ids_T,
             DevPtr<const int32_t> pos_T, uint64_t key);
  void embed_backward(Param& table, DevPtr<T> dx_local, DevPtr<const int32_t> ids_T,
                      DevPtr<const int32_t> pos_T, uint64_t key);
  // The output head fused with the cross entropy on h_local [T_local, H] (the decoder's or an MTP
  // depth's), and its backward (dh_local assigned).
  void head_forward(DevPtr<const T> h_local, DevPtr<const int32_t> targets_T, DevPtr<T> lse_T,
                    DevPtr<double> sum);
  void head_backward(DevPtr<T> dh_local, DevPtr<const T> h_local, DevPtr<const int32_t> targets_T,
                     DevPtr<const T> lse_T, DevPtr<const T> dloss);
  // The whole model in one chunk: forward(), backward(), forward_logits().
  void check_whole(const char* what) const;
  struct Chunk {
    parallel::VirtualStage stage;
    int64_t block_begin = 0;        // its first block in blocks_
    std::vector<DevPtr<T>> stream;  // residual stream at its layer boundaries, [n + 1] x [T, H]
    bool final_norm = false;        // the decoder's final norm runs after its layers
    bool mtp = false;               // it runs the MTP depths
    // Boundary activations it receives / sends: 1, or 1 + D from the MTP layers' stage on
    // (stream[0] then holds all of them: such a chunk has no decoder layer).
    int64_t in_width = 1, out_width = 1;
    DevPtr<T> output = nullptr;     // what it sends on: stream.back(), or mtp_out_
    // bf16 residual: stream.back() passes through a workspace and the final norm's backward
    // reads its bf16 copy final_x16_.
    bool final_in16 = false;
  };
  // The decoder's final-normed hidden states h_0 of chunk ch's last forward: its final norm's
  // output, or (on a stage after it) its input's first block.
  DevPtr<T> h0_of(const Chunk& ch) const { return ch.final_norm ? final_n_ : ch.stream.back(); }
  std::vector<Chunk> chunks_;
  std::vector<int64_t> block_layer_;  // blocks_[i]'s global layer
  // Every block held here, the MTP depths' after the decoder's, with its layer (L + j for MTP
  // depth j's): what the routers' and training-mode loops visit.
  std::vector<TransformerBlock<T>*> all_blocks_;
  std::vector<int64_t> all_layers_;
  bool embedding_dropping() const { return training_ && cfg_.hidden_dropout > 0; }
  void stage_done(int stage) {
    if (grad_ready_) grad_ready_(stage);
  }
  void params_needed(int stage) {
    if (params_needed_) params_needed_(stage);
  }

  // The report's lm loss sum and count (and the MTP depths') summed over the CP group.
  void sum_loss_over_cp(DevPtr<ops::MicroBatchReport> report);

  ModelConfig cfg_;
  const parallel::ProcessGroups* groups_ = nullptr;
  // Context parallelism (one rank: inactive): S_ is this rank's S/cp positions of a sequence.
  parallel::ContextParallel cp_;
  int64_t S_, B_, T_;
  ParamRegistry params_;
  Arena arena_;
  ops::RopeCache rope_;
  ops::RopeMlaCache mla_rope_;  // multi-latent attention's tables (model.mla_rope_cos / _sin)
  Param* embedding_ = nullptr;  // null on a rank without the embedding
  Param* pos_embedding_ = nullptr;  // [max positions, H] with learned_absolute
  std::unique_ptr<nn::Norm<T>> final_norm_;
  Param* head_ = nullptr;  // null on a rank without the loss
  uint64_t emb_drop_key_;  // the embedding dropout's stream
  std::vector<std::unique_ptr<TransformerBlock<T>>> blocks_;
  // Multi-token prediction on the rank with the loss (null without --mtp-num-layers): its
  // depths look up mtp_table_ (the embedding, the tied copy, or their own copy of the table) and
  // carry their gradient of the final norm's output in mtp_dh0_.
  std::unique_ptr<MtpBlock<T>> mtp_;
  Param* mtp_table_ = nullptr;
  DevPtr<T> mtp_dh0_ = nullptr;
  // The depths' losses on the rank with the loss (null without MTP), and on a standalone MTP
  // stage what it sends on: [1 + D, T_local, H] h_0, h_1 .. h_D.
  std::unique_ptr<MtpLoss<T>> mtp_loss_;
  DevPtr<T> mtp_out_ = nullptr;
  // The rank's chunk whose backward finalises the gradients of stage 0 (the final norm, the MTP
  // depths, an untied head): its lowest chunk holding any (the last to run its backward).
  int stage0_chunk_ = -1;
  std::vector<std::vector<const Param*>> grad_stages_;
  std::function<void(int)> grad_ready_;
  std::function<void(int)> params_needed_;
  bool training_ = true;  // set_training's
  ops::HeadLossShape head_shape_;
  DevPtr<int32_t> ids_T_ = nullptr;
  DevPtr<int32_t> targets_T_ = nullptr;
  MicroBatchIO io_;                             // the last forward's
  DevPtr<ops::MicroBatchReport> own_report_ = nullptr;  // forward(ids, targets)'s slot
  DevPtr<int64_t> own_tokens_E_ = nullptr;
  DevPtr<T> dloss_ = nullptr;      // d(loss) / d(each token's CE): loss_grad_scale / counted
  DevPtr<T> final_n_ = nullptr;
  DevPtr<bf16> final_x16_ = nullptr;  // Chunk::final_in16: the final norm's input, kept as bf16
  // The bf16 residual: the final norm's output kept as bf16 (final_n_ then a pass-through
  // buffer; null where the output is f32: sent on, or without the bf16 stream).
  DevPtr<bf16> final_n16_ = nullptr;
  DevPtr<int32_t> pos_T_ = nullptr;  // each token's position s (t = s * B + b), filled once
  DevPtr<T> pos_TH_ = nullptr;       // the position embedding rows (workspace)
  DevPtr<ops::DropoutCounters> own_counters_ = nullptr;
  DevPtr<const ops::DropoutCounters> counters_ = nullptr;  // the last forward's
  DevPtr<T> loss_T_ = nullptr;
  DevPtr<T> lse_T_ = nullptr;
  DevPtr<T> head_ws_ = nullptr;
  ops::HeadLossBf16 head16_;  // --bf16 head GEMM inputs
  // The head input whose forms the head's buffers hold (its whole form in vp_full_ with SP, its
  // bf16 form in head16_): the last head forward's input, or its backward's after a regather;
  // null once anything else wrote them (the embedding's SP partial, forward_logits).
  DevPtr<const T> head_input_held_ = nullptr;
  DevPtr<float> logits_ws32_ = nullptr;  // --bf16 forward_logits: gemm_bf16's workspace
  void embedding_lookup(const Param& table, DevPtr<T> y_TH, DevPtr<const int32_t> ids_T,
                        int64_t n_tok, int64_t rows);
  // Tensor parallelism (one rank: inactive, and none of the members below is used).
  parallel::TensorParallel tp_;
  int64_t T_local_ = 0;                 // tp_.local_tokens(T_): the residual stream's tokens
  DevPtr<T> vp_full_ = nullptr;         // [T, H] with SP: the embedding's partial, the head input
  DevPtr<T> vp_dfull_ = nullptr;        // [T, H] with SP: the head's partial input gradient
  DevPtr<bf16> vp_wire16_ = nullptr;    // --bf16 with SP: the head all-gather's bf16 staging
  DevPtr<T> vp_head_slice_ = nullptr;   // [Vp/tp, H] forward_logits' slice of another TP rank
  VocabHeadWorkspace<T> vp_ws_;
  // --bf16 on the native GEMM path: a vocabulary slice's bf16 values widened to f32 [Vp/tp, H]
  // (the embedding lookup, forward_logits' gathered head; its model rows).
  DevPtr<float> vp_w32_ = nullptr;
  // The head's f32 values for the f32 head (null under --bf16: the head reads head16_).
  DevPtr<const T> head_values() const {
    return cfg_.bf16 ? DevPtr<const T>(nullptr) : DevPtr<const T>(head_->template data_as<T>());
  }
  DevPtr<T> dstream_ = nullptr;
  DevPtr<T> dfinal_ = nullptr;
};

}  // namespace moecore::model
