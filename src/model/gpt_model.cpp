#include "model/gpt_model.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/rng.h"
#include "ops/add.h"
#include "ops/cast.h"
#include "ops/dropout.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/memory.h"
#include "ops/gemm_bf16.h"
#include "ops/rmsnorm.h"
#include "ops/token_layout.h"

namespace moecore::model {

template <typename T>
GPTModel<T>::GPTModel(const ModelConfig& cfg, int64_t micro_batch, uint64_t seed,
                      const parallel::ProcessGroups* groups, bool size_only, const Exec& ex,
                      std::vector<parallel::VirtualStage> chunks)
    : cfg_(cfg),
      groups_(groups),
      cp_(parallel::ContextParallel::attention(groups, 0)),
      S_(cfg.seq_length / cp_.size()),
      B_(micro_batch),
      T_(S_ * micro_batch),
      params_(DTypeOf<T>::value),
      arena_(ex) {
  cfg_.validate();
  // Context parallelism: this rank holds S/cp positions of each sequence (two chunks of the
  // load-balanced split); every buffer below is planned for them.
  if (cp_.active()) {
    parallel::check_context_split(cp_.split(cfg_.seq_length));
    // MTP's ids and targets are rolled on the whole sequences before the split (the trainer's
    // MicroBatchIO::mtp_ids_BS): nothing crosses the CP ranks' chunks by communication. Learned
    // positions would have to be rolled the same way: not built.
    MOE_CHECK(cfg_.mtp_num_layers == 0 ||
                  cfg_.position_embedding != PositionEmbedding::LearnedAbsolute,
              "[model] --mtp-num-layers {} with --context-parallel-size {} and "
              "--position-embedding-type learned_absolute is not implemented yet: use rope",
              cfg_.mtp_num_layers, cp_.size());
  }
  tp_ = parallel::TensorParallel::attention(groups);
  T_local_ = tp_.local_tokens(T_);
  if (tp_.active()) {
    MOE_CHECK(cfg_.padded_vocab() % tp_.size() == 0,
              "[model] the padded vocabulary {} is not divisible by --tensor-model-parallel-size "
              "{}: the embedding and output head are split over the vocabulary (pad it with "
              "--make-vocab-size-divisible-by; the padding is a multiple of that times the TP "
              "size)",
              cfg_.padded_vocab(), tp_.size());
    MOE_CHECK(!tp_.sequence_parallel() || T_ % tp_.size() == 0,
              "[model] {} tokens per micro-batch are not divisible by --tensor-model-parallel-size "
              "{} (--sequence-parallel splits them)",
              T_, tp_.size());
  }
  cfg_.moe.router.seed = seed;  // the routers' input-jitter streams
  MOE_CHECK(micro_batch >= 1, "[model] --micro-batch-size={} must be >= 1", micro_batch);
  if (cfg_.bf16) {
    MOE_CHECK((std::is_same_v<T, float>), "[model] --bf16 needs f32 master weights");
    // Before any layer reads has_bf16_copy(). The widened-bf16 GEMM path reads f32 copies of the
    // bf16 weights, kept up to date by the optimizer's pass, rather than widening each weight
    // at each GEMM (that cost ~15% of the GEMM time at bench-small's shapes).
    params_.enable_bf16_copies(ops::bf16_gemm_path(ex) == ops::Bf16GemmPath::Widen,
                               /*master=*/!cfg_.master_weights_sharded);
  }
  // Vocab-parallel under TP: each rank holds its dim-0 slice of the padded vocabulary. The rows
  // past the model's vocabulary are padding (model_rows): zero, never read, never trained.
  const int64_t V = cfg_.vocab_size, Vp = cfg_.padded_vocab();
  const ParamSlice vocab_slice = tp_.shard().slice(0, Vp);
  const TpRole vocab_role = tp_.shard().sharded();
  if (chunks.empty()) {
    chunks.push_back(parallel::VirtualStage{0, cfg_.num_layers, cfg_.mtp_num_layers, true, true});
  }
  bool has_embedding = false, has_loss = false, has_mtp = false, has_final_norm = false;
  const int64_t D = cfg_.mtp_num_layers;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const parallel::VirtualStage& v = chunks[c];
    MOE_CHECK(v.first_layer >= 0 && v.num_layers >= 0 &&
                  v.first_layer + v.num_layers <= cfg_.num_layers,
              "[model] pipeline chunk {} holds layers [{}, {}) of a model of {} layers", c,
              v.first_layer, v.first_layer + v.num_layers, cfg_.num_layers);
    // Megatron's placement of the MTP layers: all in one virtual stage, the last of its rank,
    // after every decoder layer; the loss in it or in a stage after it.
    MOE_CHECK(v.num_mtp_layers == 0 || v.num_mtp_layers == D,
              "[model] pipeline chunk {} holds {} MTP layers, --mtp-num-layers is {}: all of them "
              "run in one virtual stage",
              c, v.num_mtp_layers, D);
    MOE_CHECK(!v.loss || D == 0 || v.num_mtp_layers == D || v.mtp_before,
              "[model] pipeline chunk {} holds the loss of a model with {} MTP layers but no "
              "stage runs them: place the m's of --pipeline-model-parallel-layout beside or "
              "before the L",
              c, D);
    MOE_CHECK((v.num_mtp_layers == 0 && !v.mtp_before) || v.first_layer + v.num_layers == cfg_.num_layers,
              "[model] pipeline chunk {} holds MTP layers or their hidden states before decoder "
              "layer {}: the MTP layers come after every decoder layer",
              c, v.first_layer + v.num_layers);
    MOE_CHECK(!v.mtp_before || (v.num_layers == 0 && v.num_mtp_layers == 0),
              "[model] pipeline chunk {} after the MTP layers' stage holds {} decoder and {} MTP "
              "layers: the stages after it pass their hidden states on to the loss",
              c, v.num_layers, v.num_mtp_layers);
    MOE_CHECK(v.num_mtp_layers == 0 || c + 1 == chunks.size(),
              "[model] the MTP layers must be in the rank's last chunk (Megatron's rule), not "
              "chunk {} of {}",
              c, chunks.size());
    has_mtp |= v.num_mtp_layers > 0;
    // The final norm after the decoder's last layer with MTP, on the loss's stage without.
    has_final_norm |= D > 0 ? v.num_layers > 0 && v.first_layer + v.num_layers == cfg_.num_layers
                            : v.loss;
    MOE_CHECK(c == 0 || v.first_layer >= chunks[c - 1].first_layer + chunks[c - 1].num_layers,
              "[model] pipeline chunks must hold increasing layers");
    MOE_CHECK(!v.embedding || c == 0, "[model] the embedding must be on the rank's first chunk");
    MOE_CHECK(!v.loss || c + 1 == chunks.size(), "[model] the loss must be on the last chunk");
    has_embedding |= v.embedding;
    has_loss |= v.loss;
  }
  // The vocabulary tables: the embedding, an untied output layer, the last stage's tied copy.
  const auto table_spec = [&](const char* name) {
    return ParamSpec{name,
                     {Vp, cfg_.hidden},
                     ParamInit::Normal,
                     cfg_.init_std,
                     ParamKind::Dense,
                     true,
                     vocab_slice,
                     /*bf16_only=*/true,
                     vocab_role,
                     /*model_rows=*/V};
  };
  constexpr const char* kTable = "embedding.word_embeddings.weight";
  if (has_embedding) embedding_ = &params_.add(table_spec(kTable));
  if (has_embedding && cfg_.position_embedding == PositionEmbedding::LearnedAbsolute) {
    pos_embedding_ = &params_.add(ParamSpec{"embedding.position_embeddings.weight",
                                            {cfg_.max_positions(), cfg_.hidden},
                                            ParamInit::Normal,
                                            cfg_.init_std,
                                            ParamKind::Dense,
                                            true,
                                            {},
                                            /*bf16_only=*/true,
                                            tp_.token_role()});
  }
  emb_drop_key_ = rng_key(seed, "embedding.dropout");
  // Each block's parameters are the ones it registers: they form its backward stage.
  std::vector<size_t> block_first;
  for (const parallel::VirtualStage& v : chunks) {
    Chunk ch{v, static_cast<int64_t>(blocks_.size()), {}};
    ch.final_norm = D > 0 ? v.num_layers > 0 && v.first_layer + v.num_layers == cfg_.num_layers
                          : v.loss;
    ch.mtp = v.num_mtp_layers > 0;
    ch.in_width = v.mtp_before ? 1 + D : 1;
    ch.out_width = v.mtp_before || ch.mtp ? 1 + D : 1;
    chunks_.push_back(std::move(ch));
    for (int64_t l = v.first_layer; l < v.first_layer + v.num_layers; ++l) {
      block_first.push_back(params_.params().size());
      block_layer_.push_back(l);
      blocks_.push_back(
          std::make_unique<TransformerBlock<T>>(cfg_, l, params_, rope_, groups_, seed, &mla_rope_));
    }
  }
  block_first.push_back(params_.params().size());
  if (has_final_norm) {
    final_norm_ = std::make_unique<nn::Norm<T>>(
        norm_config(cfg_), params_, "decoder.final_layernorm", tp_.token_role());
  }
  if (has_mtp) {
    MOE_CHECK(has_embedding || cfg_.position_embedding != PositionEmbedding::LearnedAbsolute,
              "[model] multi-token prediction with learned absolute positions on a pipeline "
              "stage without the embedding is not implemented yet (that stage would need "
              "its own copy of the position table, kept equal to the first stage's): use "
              "--position-embedding-type rope, or no pipeline parallelism");
    mtp_ = std::make_unique<MtpBlock<T>>(cfg_, params_, rope_, groups_, seed, &mla_rope_);
  }
  if (has_loss && D > 0) {
    mtp_loss_ = std::make_unique<MtpLoss<T>>(cfg_);
    if (mtp_ != nullptr) mtp_->set_loss(mtp_loss_.get());  // beside the loss: the same chunk
  }
  const size_t final_norm_end = params_.params().size();  // the final norm's and the MTP's
  // Stage 0's parameters: the final norm, the MTP depths, an untied head (registered below).
  for (size_t c = 0; c < chunks_.size() && stage0_chunk_ < 0; ++c) {
    const Chunk& ch = chunks_[c];
    if (ch.final_norm || ch.mtp || (ch.stage.loss && !cfg_.tie_embeddings))
      stage0_chunk_ = static_cast<int>(c);
  }
  // Tied (Megatron's default): the output head is the embedding table and both gradients add.
  // A last pipeline stage without the embedding holds a copy of it (Megatron's shared
  // embedding): the same name and initial values, its gradient summed with the first stage's.
  if (has_loss && cfg_.tie_embeddings && !has_embedding) {
    ParamSpec spec = table_spec(kTable);
    spec.pipeline_copy = true;
    head_ = &params_.add(spec);
  } else if (has_loss) {
    head_ = cfg_.tie_embeddings ? embedding_ : &params_.add(table_spec("output_layer.weight"));
  }
  // MTP embeds with the model's table: the embedding, the tied head's copy, or with an untied
  // head a copy of its own (Megatron's last stage builds the embedding for its MTP layers).
  if (mtp_ != nullptr) {
    mtp_table_ = embedding_ != nullptr ? embedding_ : cfg_.tie_embeddings ? head_ : nullptr;
    if (mtp_table_ == nullptr) {
      ParamSpec spec = table_spec(kTable);
      spec.pipeline_copy = true;
      mtp_table_ = &params_.add(spec);
    }
  }
  // The head's GEMMs and the cross entropy run over the model's V rows only (the fused one-rank
  // head: N = V of the table's first rows; vocab-parallel: each rank's model rows).
  head_shape_ = ops::HeadLossShape{T_, cfg_.hidden, V, kHeadChunk};

  // The stages are numbered as on one rank (global layers); a pipeline stage's others are empty.
  grad_stages_.assign(cfg_.num_layers + 2, {});
  for (size_t i = block_first.back(); i < final_norm_end; ++i)
    grad_stages_[0].push_back(&params_.params()[i]);  // the final norm's
  if (head_ != nullptr && !cfg_.tie_embeddings) grad_stages_[0].push_back(head_);
  for (size_t b = 0; b < blocks_.size(); ++b) {
    auto& stage = grad_stages_[cfg_.num_layers - block_layer_[b]];
    for (size_t i = block_first[b]; i < block_first[b + 1]; ++i) {
      stage.push_back(&params_.params()[i]);
    }
  }
  // The embedding's stage: the table (or the last stage's copy of it), the positions.
  if (Param* table = shared_embedding(); table != nullptr && embedding_ == nullptr)
    grad_stages_.back().push_back(table);
  if (embedding_ != nullptr) grad_stages_.back().push_back(embedding_);
  if (pos_embedding_ != nullptr) grad_stages_.back().push_back(pos_embedding_);
  size_t staged = 0;
  for (const auto& s : grad_stages_) staged += s.size();
  MOE_CHECK(staged == params_.params().size(),
            "[model] {} parameters are registered but {} are in backward stages: a parameter "
            "was registered outside its block",
            params_.params().size(), staged);

  for (size_t b = 0; b < blocks_.size(); ++b) {
    all_blocks_.push_back(blocks_[b].get());
    all_layers_.push_back(block_layer_[b]);
  }
  if (mtp_ != nullptr) {
    for (int64_t j = 0; j < mtp_->depths(); ++j) {
      all_blocks_.push_back(&mtp_->layer(j).block());
      all_layers_.push_back(cfg_.num_layers + j);
    }
  }
  routing_slots();  // every block is listed now
  if (mtp_ != nullptr) {
    mtp_->set_ends(typename MtpBlock<T>::Ends{
        [this](DevPtr<T> x, DevPtr<const int32_t> ids, DevPtr<const int32_t> pos, uint64_t key) {
          embed(*mtp_table_, x, ids, pos, key);
        },
        [this](DevPtr<T> dx, DevPtr<const int32_t> ids, DevPtr<const int32_t> pos, uint64_t key) {
          embed_backward(*mtp_table_, dx, ids, pos, key);
        }});
  }
  if (mtp_loss_ != nullptr) {
    mtp_loss_->set_head(typename MtpLoss<T>::Head{
        [this](DevPtr<const T> h, DevPtr<const int32_t> targets, DevPtr<T> lse,
               DevPtr<double> sum) { head_forward(h, targets, lse, sum); },
        [this](DevPtr<T> dh, DevPtr<const T> h, DevPtr<const int32_t> targets,
               DevPtr<const T> lse, DevPtr<const T> dloss) {
          head_backward(dh, h, targets, lse, dloss);
        }});
  }

  if (size_only) {
    arena_.size_only([this](Arena& a) { allocate(a); });
    return;
  }
  arena_.plan([this](Arena& a) { allocate(a); });
  params_.init(seed);
  params_.refresh_bf16();
}

template <typename T>
void GPTModel<T>::allocate(Arena& a) {
  params_.allocate(a);
  const int64_t H = cfg_.hidden;
  ids_T_ = a.alloc<int32_t>(T_, "model.ids");
  targets_T_ = a.alloc<int32_t>(T_, "model.targets");
  own_report_ = a.alloc<ops::MicroBatchReport>(1, "model.report", MemKind::State);
  own_tokens_E_ = a.alloc<int64_t>(std::max<int64_t>(cfg_.num_experts, 1), "model.report_tokens",
                                   MemKind::State);
  dloss_ = a.alloc<T>(1, "model.dloss", MemKind::Workspace);
  // The residual stream at each layer boundary. Full recomputation keeps only the streams at
  // chunk boundaries: the ones inside a chunk are recomputed with it.
  // A pipeline chunk keeps its input and output (the stage boundaries).
  const RecomputeConfig& rc = cfg_.recompute;
  // After the MTP layers' stage a chunk holds no layer: its one stream buffer is what it
  // receives and passes on, every depth's hidden states after the decoder's.
  // bf16 residual (Megatron-Core's bf16 hidden states): a boundary read by a block or by the
  // final norm is not kept in f32: its reader keeps the bf16 copy (TransformerBlock::
  // keep_input_bf16, final_x16_), and the f32 values pass through one of two alternating
  // workspaces. The boundary that is sent on (a pipeline stage's output) stays f32.
  const bool resid16 = std::is_same_v<T, float> && cfg_.bf16_residual();
  DevPtr<T> pass[2] = {nullptr, nullptr};
  bool pass_made = false;
  final_x16_ = nullptr;
  for (Chunk& ch : chunks_) {
    const int64_t n = ch.stage.num_layers, first = ch.stage.first_layer;
    ch.stream.assign(n + 1, nullptr);
    ch.final_in16 = false;
    for (int64_t j = 0; j <= n; ++j) {
      const int64_t chunk = j > 0 && j < n ? rc.chunk_of(first + j - 1) : -1;
      // Under full recomputation too: the chunk's first block keeps its input's bf16 copy,
      // restored into the pass-through buffer before the chunk is recomputed; the others'
      // copies are recomputed with the chunk.
      const bool passed = resid16 && n > 0 && (j < n || ch.final_norm);
      if (!passed && chunk >= 0 && rc.chunk_of(first + j) == chunk) {
        Arena::Share share(a, "recompute", chunk, {MemKind::Recomputed});
        ch.stream[j] = a.alloc<T>(T_local_ * H, "model.residual", MemKind::Recomputed);
      } else if (passed) {
        if (!pass_made) {
          pass[0] = a.alloc<T>(T_local_ * H, "model.residual_pass", MemKind::Workspace);
          pass[1] = a.alloc<T>(T_local_ * H, "model.residual_pass", MemKind::Workspace);
          pass_made = true;
        }
        ch.stream[j] = pass[j % 2];
        if (j < n) {
          const int64_t own = rc.chunk_of(first + j);
          const bool starts = own >= 0 && (j == 0 || rc.chunk_of(first + j - 1) != own);
          blocks_[ch.block_begin + j]->keep_input_bf16(ch.stream[j], starts);
        } else {
          ch.final_in16 = true;
          if constexpr (std::is_same_v<T, float>)
            final_x16_ = a.alloc<bf16>(T_local_ * H, "model.final_norm_input_bf16");
        }
      } else {
        ch.stream[j] = a.alloc<T>(ch.in_width * T_local_ * H, "model.residual");
      }
    }
    ch.output = ch.stream.back();
  }
  if (cfg_.multi_latent_attention) {
    // MLA's own tables (Megatron's MLA builds its rotary embedding, the model none): the rotated
    // dims only, interleaved, plain or YaRN, the attention factor folded in.
    const ops::RopeMlaSpec spec = cfg_.mla.rope_spec(cfg_.rotary_base);
    const int64_t n = ops::rope_mla_table_elems(cfg_.max_positions(), spec);
    const DevPtr<double> cos_PD = a.alloc<double>(n, "model.mla_rope_cos", MemKind::State);
    const DevPtr<double> sin_PD = a.alloc<double>(n, "model.mla_rope_sin", MemKind::State);
    if (cos_PD != nullptr) {
      mla_rope_ =
          ops::make_rope_mla_cache(a.exec(), cos_PD, sin_PD, cfg_.max_positions(), spec);
    }
  } else if (cfg_.position_embedding == PositionEmbedding::Rope) {
    // The cos / sin tables, filled once here, before the layers check their lengths against
    // them (a sizing pass, which allocates nothing, skips the fill: it would be most of the
    // planner's time). Other positions use no table.
    const int64_t n =
        ops::rope_table_elems(cfg_.max_positions(), cfg_.head_dim(), cfg_.rotary_base);
    const DevPtr<double> cos_PD = a.alloc<double>(n, "model.rope_cos", MemKind::State);
    const DevPtr<double> sin_PD = a.alloc<double>(n, "model.rope_sin", MemKind::State);
    if (cos_PD != nullptr) {
      rope_ = ops::make_rope_cache(a.exec(), cos_PD, sin_PD, cfg_.max_positions(), cfg_.head_dim(),
                                   cfg_.rotary_base);
    }
  }
  for (auto& b : blocks_) b->allocate(a, S_, B_);
  if (final_norm_ != nullptr) {
    // bf16 residual: the final norm's output is Megatron-Core's bf16 hidden states (the head's
    // and the first MTP depth's input): rounded once and kept as bf16 (final_n16_). Its f32 form
    // lives in the pass-through buffer of the last block's input (dead from that block's forward
    // to its backward, which widens its own copy into it after the final norm's backward). Not
    // on a chunk that sends the final-normed states on (a stage boundary, kept f32).
    final_n16_ = nullptr;
    const Chunk* fc = nullptr;
    for (const Chunk& ch : chunks_) {
      if (ch.final_norm) fc = &ch;
    }
    const bool sent = fc != nullptr && !fc->stage.loss && !fc->mtp;
    if (fc != nullptr && fc->final_in16 && !sent) {
      final_n16_ = a.alloc<bf16>(T_local_ * H, "model.final_norm_bf16");
      final_n_ = fc->stream[fc->stream.size() - 2];
    } else {
      final_n_ = a.alloc<T>(T_local_ * H, "model.final_norm");
    }
    final_norm_->allocate(a, T_local_, "model.final_rstd");
    // The decoder's last chunk before the MTP layers' stage sends the final-normed states on.
    for (Chunk& ch : chunks_) {
      if (ch.final_norm && !ch.stage.loss && !ch.mtp) ch.output = final_n_;
    }
  }
  if (mtp_ != nullptr) {
    mtp_->allocate(a, S_, B_, T_local_, pos_embedding_ != nullptr);
    mtp_dh0_ = a.alloc<T>(T_local_ * H, "model.mtp_dh0", MemKind::Workspace);
  }
  if (mtp_loss_ != nullptr) mtp_loss_->allocate(a, S_, B_);
  for (Chunk& ch : chunks_) {
    if (!ch.mtp || ch.stage.loss) continue;  // a standalone MTP stage: h_0 .. h_D sent on
    mtp_out_ = a.alloc<T>(ch.out_width * T_local_ * H, "model.mtp_out");
    ch.output = mtp_out_;
  }
  own_counters_ = a.alloc<ops::DropoutCounters>(1, "model.dropout_counters", MemKind::State);
  if (own_counters_ != nullptr) ops::zero(a.exec(), own_counters_, 1);  // null while planning
  if (pos_embedding_ != nullptr) {
    pos_T_ = a.alloc<int32_t>(T_, "model.positions", MemKind::State);
    pos_TH_ = a.alloc<T>(T_local_ * H, "model.position_rows", MemKind::Workspace);
    // The learned positions are the global ones of this rank's rows (two chunks under CP).
    const DevPtr<int32_t> whole =
        cp_.active() ? a.alloc<int32_t>(T_ * cp_.size(), "model.global_positions",
                                        MemKind::Workspace)
                     : DevPtr<int32_t>(nullptr);
    if (pos_T_ != nullptr) parallel::global_positions(a.exec(), cp_, pos_T_, whole, T_ / B_, B_);
  }
  // The head's and the vocabulary tables' buffers: on the stages with the embedding or the loss
  // (the vocab-parallel embedding shares some of the head's workspace).
  Param* const table = head_ != nullptr ? head_ : embedding_ != nullptr ? embedding_ : mtp_table_;
  if (table != nullptr) allocate_vocab(a, table);
  // The input gradient: 1 + D blocks on a chunk after the MTP layers' stage.
  int64_t in_width = 1;
  for (const Chunk& ch : chunks_) in_width = std::max(in_width, ch.in_width);
  dstream_ = a.alloc<T>(in_width * T_local_ * H, "model.dstream", MemKind::Workspace);
  dfinal_ = a.alloc<T>(T_local_ * H, "model.dfinal", MemKind::Workspace);
}

template <typename T>
void GPTModel<T>::allocate_vocab(Arena& a, Param* table) {
  const int64_t H = cfg_.hidden;
  loss_T_ = a.alloc<T>(T_, "model.loss");
  lse_T_ = a.alloc<T>(T_, "model.lse");
  if (cfg_.bf16 && table->has_data16w) {  // widened: f32 GEMMs on bf16 values
    head16_.w_VH_wide = table->data16w;
    head16_.h32 = a.alloc<float>(T_ * cfg_.hidden, "model.head_h32", MemKind::Workspace);
  } else if (cfg_.bf16 && tp_.active()) {  // the vocab-parallel head's: this rank's rows
    const int64_t rows = vocab_head_chunk_rows(head_shape_), Vl = tp_.share(cfg_.padded_vocab());
    head16_.w_VH = table->data16;
    head16_.h16 = a.alloc<bf16>(T_ * H, "model.head_h16", MemKind::Workspace);
    head16_.dz16 = a.alloc<bf16>(rows * Vl, "model.head_dz16", MemKind::Workspace);
    if (const int64_t n =
            vocab_head_bf16_workspace_elems(a.exec(), tp_, head_shape_, cfg_.padded_vocab());
        n > 0)
      head16_.ws32 = a.alloc<float>(n, "model.head_ws32", MemKind::Workspace);
    // forward_logits' rounded input, and a table slice's bf16 values widened (the embedding
    // lookup; forward_logits' gathered head).
    head16_.h32 = a.alloc<float>(T_ * H, "model.head_h32", MemKind::Workspace);
    vp_w32_ = a.alloc<float>(Vl * H, "model.vocab_slice_w32", MemKind::Workspace);
  } else if (cfg_.bf16) {
    head16_.w_VH = table->data16;
    head16_.h16 = a.alloc<bf16>(T_ * cfg_.hidden, "model.head_h16", MemKind::Workspace);
    head16_.dz16 = a.alloc<bf16>(ops::head_loss_workspace_elems(head_shape_), "model.head_dz16",
                                 MemKind::Workspace);
    if (const int64_t n = ops::head_loss_bf16_workspace_elems(a.exec(), head_shape_); n > 0) {
      head16_.ws32 = a.alloc<float>(n, "model.head_ws32", MemKind::Workspace);
    }
    if (const int64_t n = ops::gemm_bf16_workspace_elems(a.exec(), S_, cfg_.vocab_size, H); n > 0)
      logits_ws32_ = a.alloc<float>(n, "model.logits_ws32", MemKind::Workspace);
  }
  if (tp_.active()) {
    const int64_t rows = vocab_head_chunk_rows(head_shape_), Vl = tp_.share(cfg_.padded_vocab());
    vp_ws_.logits = a.alloc<T>(rows * Vl, "model.head_ws", MemKind::Workspace);
    vp_ws_.max = a.alloc<T>(rows, "model.head_max", MemKind::Workspace);
    vp_ws_.sums = a.alloc<double>(2 * rows, "model.head_sums", MemKind::Workspace);
    if (tp_.sequence_parallel()) {
      vp_full_ = a.alloc<T>(T_ * H, "model.tp_full", MemKind::Workspace);
      vp_dfull_ = a.alloc<T>(T_ * H, "model.tp_dfull", MemKind::Workspace);
      // --bf16: the head's input feeds only its bf16 GEMMs: gathered as bf16.
      if (std::is_same_v<T, float> && cfg_.bf16)
        vp_wire16_ = a.alloc<bf16>(tp_.enter_wire_elems(T_, H), "model.tp_full_wire16",
                                   MemKind::Workspace);
    }
    vp_head_slice_ =
        a.alloc<T>(tp_.share(cfg_.padded_vocab()) * H, "model.head_slice", MemKind::Workspace);
  } else {
    head_ws_ = a.alloc<T>(ops::head_loss_workspace_elems(head_shape_), "model.head_ws",
                          MemKind::Workspace);
  }
}

// A table's rows: under --bf16 its bf16 values (from the bf16 copy on the native path, as the
// head's GEMMs read it; its widened copy on the widened path).
template <typename T>
void GPTModel<T>::embedding_lookup(const Param& table, DevPtr<T> y_TH,
                                   DevPtr<const int32_t> ids_T, int64_t n_tok, int64_t rows) {
  const Exec& ex = arena_.exec();
  if constexpr (std::is_same_v<T, float>) {
    if (table.has_data16) {
      return ops::embedding_forward_bf16(ex, y_TH, ids_T, DevPtr<const bf16>(table.data16), n_tok,
                                         cfg_.hidden, rows);
    }
  }
  ops::embedding_forward(ex, y_TH, ids_T, table.compute_as<T>(), n_tok, cfg_.hidden, rows);
}

template <typename T>
void GPTModel<T>::check_whole(const char* what) const {
  MOE_CHECK(chunks_.size() == 1 && chunks_[0].stage.embedding && chunks_[0].stage.loss,
            "[model] {} needs the whole model on one rank; this one holds a pipeline stage",
            what);
}

template <typename T>
void GPTModel<T>::set_replay_micro_batch(int c, int64_t microbatch) {
  const Chunk& ch = chunks_[c];
  for (int64_t j = 0; j < ch.stage.num_layers; ++j) {
    if (auto* moe = blocks_[ch.block_begin + j]->moe())
      moe->router().set_replay_micro_batch(microbatch);
  }
  if (!ch.mtp) return;
  for (int64_t j = 0; j < mtp_->depths(); ++j) {
    if (auto* moe = mtp_->layer(j).block().moe()) moe->router().set_replay_micro_batch(microbatch);
  }
}

template <typename T>
void GPTModel<T>::forward_trunk(int c, const MicroBatchIO& io, DevPtr<const T> input,
                                int64_t microbatch, bool replay) {
  const Exec& ex = arena_.exec();
  Chunk& ch = chunks_[c];
  ops::zero(ex, io.report, 1);
  const int64_t E = cfg_.num_experts;
  if (E > 0) ops::zero(ex, io.tokens_per_expert_E, E);
  const int64_t H = cfg_.hidden;
  const int L = static_cast<int>(cfg_.num_layers);
  // [B, S] -> sequence-major tokens t = s * B + b: the embedding's and the MTP depths' ids, the
  // loss's targets and counted tokens (the chunks in between read neither).
  if (ch.stage.embedding || ch.stage.loss || ch.mtp) {
    ops::tokens_to_sequence_major(ex, ids_T_, targets_T_,
                                  member_ptr(io.report, &ops::MicroBatchReport::counted),
                                  io.ids_BS, io.targets_BS, B_, S_);
  }
  counters_ = io.dropout != nullptr ? io.dropout : DevPtr<const ops::DropoutCounters>(own_counters_);
  const DevPtr<T> x0 = ch.stream[0];
  if (!ch.stage.embedding) {
    MOE_CHECK(input != nullptr, "[model] pipeline chunk {} needs its input activation", c);
    // The pipeline may have written it in place (chunk_input: a bf16 boundary widened there).
    if (input != DevPtr<const T>(x0)) ops::copy(ex, x0, input, ch.in_width * T_local_ * H);
  } else {
    params_needed(L + 1);
    embed(*embedding_, x0, ids_T_, pos_embedding_ != nullptr ? pos_T_ : nullptr, emb_drop_key_);
  }
  if (replay) set_replay_micro_batch(c, microbatch);
  for (int64_t j = 0; j < ch.stage.num_layers; ++j) {
    TransformerBlock<T>& block = *blocks_[ch.block_begin + j];
    block.set_dropout_counters(counters_);
    block.set_routing_table(routing_table(io, block));
    params_needed(L - static_cast<int>(ch.stage.first_layer + j));
    block.forward(ch.stream[j + 1], ch.stream[j], /*recompute=*/replay);
    if (block.is_moe() && !replay) {  // in layer order: the report sums as the logs always did
      const moe::RouterReport r = block.moe()->router().report();
      ops::report_moe_layer(ex, io.report, io.tokens_per_expert_E, r.aux_value, r.z_value,
                            r.dropped, r.tokens_per_expert_E, E);
    }
  }
  if (!ch.stage.loss && !ch.final_norm && !ch.mtp) return;
  params_needed(0);  // the final norm, MTP, and the head that forward() / forward_logits() run next
  if (embedding_ == nullptr && shared_embedding() != nullptr && (ch.stage.loss || ch.mtp))
    params_needed(L + 1);  // this stage's copy of the table (the tied head's, MTP's)
  if (ch.final_norm) {
    final_norm_->forward(ex, final_n_, DevPtr<const T>(ch.stream.back()), T_local_,
                         final_n16_ != nullptr);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (ch.final_in16)  // exact: the last block's output holds bf16 values
      ops::cast_f32_to_bf16(ex, final_x16_, DevPtr<const float>(ch.stream.back()), T_local_ * H);
    if (ch.final_norm && final_n16_ != nullptr)  // exact: rounded by the norm
      ops::cast_f32_to_bf16(ex, final_n16_, DevPtr<const float>(final_n_), T_local_ * H);
  }
}

template <typename T>
void GPTModel<T>::forward(const MicroBatchIO& io) {
  check_whole("forward()");
  forward_chunk(0, io, nullptr, -1);
}

template <typename T>
void GPTModel<T>::forward_chunk(int c, const MicroBatchIO& io_in, DevPtr<const T> input,
                                int64_t microbatch, bool replay) {
  MicroBatchIO io = io_in;
  if (replay) {  // the values again for the backward; the step's report keeps the first's
    io.report = own_report_;
    io.tokens_per_expert_E = own_tokens_E_;
  }
  io_ = io;
  forward_trunk(c, io, input, microbatch, replay);
  const Chunk& ch = chunks_[c];
  const DevPtr<T> h0 = h0_of(ch);
  if (ch.stage.loss) {
    head_forward(h0, targets_T_, lse_T_, member_ptr(io.report, &ops::MicroBatchReport::lm_loss_sum));
  }
  const int64_t n = T_local_ * cfg_.hidden;
  if (ch.mtp) {
    for (int64_t j = 0; j < mtp_->depths(); ++j) {
      TransformerBlock<T>& block = mtp_->layer(j).block();
      block.set_dropout_counters(counters_);
      block.set_routing_table(routing_table(io, block));
    }
    MOE_CHECK(!cp_.active() || io.mtp_ids_BS != nullptr,
              "[model] multi-token prediction under context parallelism needs each depth's ids "
              "and targets rolled on the whole sequences (MicroBatchIO::mtp_ids_BS)");
    mtp_->forward(h0, ids_T_, targets_T_, pos_embedding_ != nullptr ? pos_T_ : nullptr,
                  io.report, io.tokens_per_expert_E, replay, io.mtp_ids_BS, io.mtp_targets_BS);
    if (!ch.stage.loss) {  // Megatron's torch.cat of the hidden states, sent on
      const Exec& ex = arena_.exec();
      ops::copy(ex, mtp_out_, DevPtr<const T>(h0), n);
      for (int64_t j = 0; j < mtp_->depths(); ++j)
        ops::copy(ex, mtp_out_ + (j + 1) * n, mtp_->layer(j).out(), n);
    }
  } else if (ch.stage.loss && ch.stage.mtp_before) {
    MOE_CHECK(!cp_.active() || io.mtp_targets_BS != nullptr,
              "[model] multi-token prediction under context parallelism needs each depth's "
              "targets rolled on the whole sequences (MicroBatchIO::mtp_targets_BS)");
    // Megatron's process_mtp_loss: the boundary split into h_0 (above) and each depth's h_k.
    for (int64_t j = 0; j < mtp_loss_->depths(); ++j)
      mtp_loss_->forward(j, h0 + (j + 1) * n, targets_T_, io.report,
                         io.mtp_targets_BS != nullptr ? io.mtp_targets_BS + j * T_ : nullptr);
  }
  if (ch.stage.loss && cp_.active()) sum_loss_over_cp(io.report);
}

// Megatron's loss_func all-reduces [loss sum, token count] over the cp group: each CP rank holds
// part of every sequence, so the micro-batch's mean (and the backward's 1 / counted) is over the
// sequences' counted tokens on all CP ranks. Every CP rank then reports the same values.
template <typename T>
void GPTModel<T>::sum_loss_over_cp(DevPtr<ops::MicroBatchReport> report) {
  const Exec& ex = arena_.exec();
  parallel::Communicator& comm = cp_.communicator();
  const auto sum = [&](auto p, int64_t n, DType dt) {
    comm.all_reduce_async(p, n, dt, parallel::ReduceOp::Sum).wait_on(ex);
  };
  sum(member_ptr(report, &ops::MicroBatchReport::lm_loss_sum), 1, DType::F64);
  sum(member_ptr(report, &ops::MicroBatchReport::counted), 1, DType::I64);
  if (const int64_t D = cfg_.mtp_num_layers; D > 0) {
    sum(ops::mtp_loss_sum_ptr(report, 0), D, DType::F64);
    sum(ops::mtp_counted_ptr(report, 0), D, DType::I64);
  }
}

template <typename T>
void GPTModel<T>::embed(const Param& table, DevPtr<T> x_local, DevPtr<const int32_t> ids_T,
                        DevPtr<const int32_t> pos_T, uint64_t key) {
  const Exec& ex = arena_.exec();
  const int64_t H = cfg_.hidden;
  const int64_t first = tp_.first_token(T_);  // the local tokens' first (0 without SP)
  if (tp_.active()) {  // this rank's vocabulary rows, summed over TP (to this rank's tokens)
    const DevPtr<T> partial = tp_.sequence_parallel() ? vp_full_ : x_local;
    if (tp_.sequence_parallel()) head_input_held_ = nullptr;
    bool done = false;
    if constexpr (std::is_same_v<T, float>) {
      if (table.has_data16) {  // --bf16, the bf16 copy: its values, as on one rank
        vocab_parallel_embedding_forward_bf16(ex, tp_, x_local, partial, ids_T,
                                              DevPtr<const bf16>(table.data16), vp_w32_, T_, H,
                                              cfg_.vocab_size, cfg_.padded_vocab());
        done = true;
      }
    }
    if (!done) {
      vocab_parallel_embedding_forward(ex, tp_, x_local, partial, ids_T, table.compute_as<T>(), T_,
                                       H, cfg_.vocab_size, cfg_.padded_vocab());
    }
  } else {
    embedding_lookup(table, x_local, ids_T, T_, cfg_.vocab_size);
  }
  if (pos_T != nullptr) {
    embedding_lookup(*pos_embedding_, pos_TH_, pos_T + first, T_local_, cfg_.max_positions());
    ops::add(ex, x_local, DevPtr<const T>(x_local), DevPtr<const T>(pos_TH_), T_local_ * H);
  }
  // Megatron's embedding dropout is the hidden dropout, on the summed embeddings.
  if (embedding_dropping()) {
    parallel::for_each_position_run(
        cp_.split(cfg_.seq_length), first / B_, T_local_ / B_,
        [&](int64_t row, int64_t rows, int64_t pos) {
          const DevPtr<T> x = x_local + (row - first / B_) * B_ * H;
          ops::dropout_forward(ex, x, DevPtr<const T>(x), cfg_.hidden_dropout, key, counters_,
                               rows, B_, H, pos);
        });
  }
  // bf16 residual: Megatron-Core's embedding output is bf16 (after its dropout).
  if constexpr (std::is_same_v<T, float>) {
    if (cfg_.bf16_residual())
      ops::round_f32_to_bf16(ex, x_local, DevPtr<const float>(x_local), T_local_ * H);
  }
}

template <typename T>
void GPTModel<T>::embed_backward(Param& table, DevPtr<T> dx_local, DevPtr<const int32_t> ids_T,
                                 DevPtr<const int32_t> pos_T, uint64_t key) {
  const Exec& ex = arena_.exec();
  const int64_t H = cfg_.hidden;
  if (embedding_dropping()) {
    const int64_t s0 = tp_.first_token(T_) / B_;
    parallel::for_each_position_run(
        cp_.split(cfg_.seq_length), s0, T_local_ / B_,
        [&](int64_t row, int64_t rows, int64_t pos) {
          const DevPtr<T> dx = dx_local + (row - s0) * B_ * H;
          ops::dropout_backward(ex, dx, DevPtr<const T>(dx), cfg_.hidden_dropout, key, counters_,
                                rows, B_, H, pos);
        });
  }
  if (tp_.active()) {
    vocab_parallel_embedding_backward(ex, tp_, table.grad_as<T>(), DevPtr<const T>(dx_local),
                                      vp_dfull_, ids_T, T_, H, cfg_.vocab_size,
                                      cfg_.padded_vocab());
  } else {
    ops::embedding_backward(ex, table.grad_as<T>(), DevPtr<const T>(dx_local), ids_T, T_, H,
                            cfg_.vocab_size);
  }
  if (pos_T != nullptr)
    ops::embedding_backward(ex, pos_embedding_->grad_as<T>(), DevPtr<const T>(dx_local),
                            pos_T + tp_.first_token(T_), T_local_, H, cfg_.max_positions());
}

template <typename T>
void GPTModel<T>::head_forward(DevPtr<const T> h_local, DevPtr<const int32_t> targets_T,
                               DevPtr<T> lse_T, DevPtr<double> sum) {
  const Exec& ex = arena_.exec();
  head_input_held_ = h_local;
  if (tp_.active()) {
    const DevPtr<const T> h =
        tp_.enter(ex, h_local, vp_full_, T_, cfg_.hidden, vp_wire16_);  // [T, H]
    vocab_parallel_head_loss_forward(ex, tp_, sum, loss_T_, lse_T, h, head_values(), targets_T,
                                     head_shape_, cfg_.padded_vocab(), vp_ws_,
                                     cfg_.bf16 ? &head16_ : nullptr);
    return;
  }
  ops::head_loss_forward(ex, sum, loss_T_, lse_T, h_local, head_values(), targets_T, head_shape_,
                         head_ws_, cfg_.bf16 ? &head16_ : nullptr);
}

template <typename T>
void GPTModel<T>::head_backward(DevPtr<T> dh_local, DevPtr<const T> h_local,
                                DevPtr<const int32_t> targets_T, DevPtr<const T> lse_T,
                                DevPtr<const T> dloss) {
  const Exec& ex = arena_.exec();
  const int64_t H = cfg_.hidden;
  const bool sp = tp_.sequence_parallel();
  // With MTP the heads (and embeddings) of the depths ran after this head's forward and used the
  // buffers its backward reads as the forward left them: the whole input (all-gathered into
  // vp_full_ with SP) and, under --bf16, its bf16 form (HeadLossBf16): both written again from
  // h, the same values; unless they still hold h's (the last head's forward before the first
  // head's backward: the last MTP depth's).
  if (mtp_loss_ != nullptr && head_input_held_ != h_local) {
    head_input_held_ = h_local;
    if (sp) tp_.enter(ex, h_local, vp_full_, T_, H, vp_wire16_);
    if constexpr (std::is_same_v<T, float>) {
      const DevPtr<const float> h = sp ? DevPtr<const float>(vp_full_) : h_local;
      if (cfg_.bf16 && head16_.w_VH_wide != nullptr)
        ops::round_f32_to_bf16(ex, head16_.h32, h, T_ * H);
      else if (cfg_.bf16)
        ops::cast_f32_to_bf16(ex, head16_.h16, h, T_ * H);
    }
  }
  if (tp_.active()) {
    // The head's input as the forward left it, this rank's partial input gradient, summed
    // (reduce-scattered with SP) into dh_local.
    const DevPtr<T> dfull = sp ? vp_dfull_ : dh_local;
    vocab_parallel_head_loss_backward(ex, tp_, dfull, head_->grad_as<T>(),
                                      sp ? DevPtr<const T>(vp_full_) : h_local, head_values(),
                                      targets_T, lse_T, dloss, head_shape_, cfg_.padded_vocab(),
                                      vp_ws_, cfg_.bf16 ? &head16_ : nullptr);
    tp_.enter_backward(ex, dfull, dh_local, T_, H);
    return;
  }
  ops::head_loss_backward(ex, dh_local, head_->grad_as<T>(), h_local, head_values(), targets_T,
                          lse_T, dloss, head_shape_, head_ws_, cfg_.bf16 ? &head16_ : nullptr);
}

template <typename T>
void GPTModel<T>::forward_logits(DevPtr<const int32_t> ids_BS, DevPtr<T> logits_BSV) {
  const bool training = training_;
  set_training(false);
  io_ = MicroBatchIO{};  // the saved activations are not a forward()'s: no backward from here
  // The ids stand in for the targets: no loss is computed.
  check_whole("forward_logits()");
  head_input_held_ = nullptr;  // its input goes through the head's buffers
  MOE_CHECK(!cp_.active(), "[model] forward_logits with --context-parallel-size {} is not "
            "implemented: the logits of the whole sequence would have to be gathered from the CP "
            "ranks; run it on one CP rank",
            cp_.size());
  forward_trunk(0, MicroBatchIO{ids_BS, ids_BS, own_report_, own_tokens_E_}, nullptr, -1, false);
  // Sequence b's tokens are every B-th row of final_n_ (t = s * B + b): one GEMM per sequence
  // with row stride B * H writes its [S, V] block of the batch-major logits.
  // Under --bf16 the GEMMs take the hidden states' bf16 values (cast, or rounded for the widened
  // path, once for the batch) and the head's bf16 copy, as the training head's do.
  const int64_t H = cfg_.hidden, V = cfg_.vocab_size, Vp = cfg_.padded_vocab();
  const Exec& ex = arena_.exec();
  if (tp_.active()) {
    // The whole input (all-gathered with SP) against each TP rank's vocabulary slice in turn
    // (its model rows broadcast from its rank: one slice of workspace, not the whole head), into
    // that slice's columns of the logits. A slice of padding only has no column.
    DevPtr<const T> h = tp_.enter(ex, DevPtr<const T>(final_n_), vp_full_, T_, H, vp_wire16_);
    DevPtr<const T> w_local = head_values();
    if constexpr (std::is_same_v<T, float>) {
      if (cfg_.bf16) {  // bf16 values (h rounded, the head's), f32 accumulation
        w_local = head16_.w_VH_wide;
        if (w_local == nullptr) {  // the bf16 copy, widened
          ops::cast_bf16_to_f32(ex, vp_w32_, head16_.w_VH, vocab_shard(tp_, V, Vp).model * H);
          w_local = vp_w32_;
        }
        ops::round_f32_to_bf16(ex, head16_.h32, h, T_ * H);
        h = head16_.h32;
      }
    }
    const int64_t Vl = tp_.share(Vp);
    for (int r = 0; r < tp_.size(); ++r) {
      const int64_t rows = std::clamp<int64_t>(V - r * Vl, 0, Vl);  // rank r's model rows
      if (rows == 0) continue;  // every rank skips it: no collective is left unmatched
      if (r == tp_.rank()) ops::copy(ex, vp_head_slice_, w_local, rows * H);
      tp_.broadcast(ex, vp_head_slice_, rows * H, r);
      for (int64_t b = 0; b < B_; ++b) {
        ops::gemm<T>(ex, false, true, S_, rows, H, T(1), h + b * H, B_ * H,
                     DevPtr<const T>(vp_head_slice_), H, T(0), logits_BSV + b * S_ * V + r * Vl, V);
      }
    }
    set_training(training);
    return;
  }
  const bool wide = cfg_.bf16 && head16_.w_VH_wide != nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (wide) ops::round_f32_to_bf16(ex, head16_.h32, DevPtr<const float>(final_n_), T_ * H);
    if (cfg_.bf16 && !wide)
      ops::cast_f32_to_bf16(ex, head16_.h16, DevPtr<const float>(final_n_), T_ * H);
  }
  for (int64_t b = 0; b < B_; ++b) {
    const DevPtr<T> out = logits_BSV + b * S_ * V;
    if constexpr (std::is_same_v<T, float>) {
      if (wide) {
        ops::gemm<float>(ex, false, true, S_, V, H, 1.f, head16_.h32 + b * H, B_ * H,
                         head16_.w_VH_wide, H, 0.f, out, V);
        continue;
      }
      if (cfg_.bf16) {
        ops::gemm_bf16(ex, false, true, S_, V, H, head16_.h16 + b * H, B_ * H, head16_.w_VH, H,
                       0.f, out, V, logits_ws32_);
        continue;
      }
    }
    ops::gemm<T>(ex, false, true, S_, V, H, T(1), final_n_ + b * H, B_ * H, head_values(), H,
                 T(0), out, V);
  }
  set_training(training);
}

template <typename T>
double GPTModel<T>::forward(DevPtr<const int32_t> ids_BS, DevPtr<const int32_t> targets_BS) {
  forward(MicroBatchIO{ids_BS, targets_BS, own_report_, own_tokens_E_});
  return mean_loss(own_report());
}

template <typename T>
ops::MicroBatchReport GPTModel<T>::own_report() const {
  return ops::read_value<ops::MicroBatchReport>(arena_.exec(), own_report_);
}

template <typename T>
double GPTModel<T>::training_loss(const ops::MicroBatchReport& r) const {
  double mtp = 0;
  for (int64_t j = 0; j < cfg_.mtp_num_layers; ++j) mtp += mtp_mean_loss(r, j);
  return mean_loss(r) +
         (cfg_.mtp_num_layers > 0
              ? cfg_.mtp_loss_scaling_factor / static_cast<double>(cfg_.mtp_num_layers) * mtp
              : 0.0);
}

template <typename T>
void GPTModel<T>::backward(double loss_grad_scale) {
  check_whole("backward()");
  backward_chunk(0, loss_grad_scale, nullptr, -1);
}

template <typename T>
void GPTModel<T>::backward_chunk(int c, double loss_grad_scale, DevPtr<const T> doutput,
                                 int64_t microbatch) {
  const int64_t H = cfg_.hidden;
  const Exec& ex = arena_.exec();
  Chunk& ch = chunks_[c];
  MOE_CHECK(io_.report != nullptr, "[model] backward() without a forward");
  if (microbatch >= 0) set_replay_micro_batch(c, microbatch);  // "moe" recomputation's jitter
  const int64_t L = cfg_.num_layers;
  const int64_t n = T_local_ * H;
  // The gradient of h_0 (the decoder's final-normed hidden states): into the final norm's
  // backward where it ran here, else it is this chunk's input gradient (its first block).
  const DevPtr<T> dh0 = ch.final_norm ? dfinal_ : dstream_;
  const DevPtr<const T> h0 = h0_of(ch);
  if constexpr (std::is_same_v<T, float>) {
    // The final norm's output kept as bf16: widened into its f32 buffer for the heads' and the
    // MTP depths' backward (the other layers' forwards used it meanwhile).
    if (ch.final_norm && final_n16_ != nullptr)
      ops::cast_bf16_to_f32(ex, final_n_, DevPtr<const bf16>(final_n16_), n);
  }
  if (ch.stage.loss) {
    // The MTP depths first (their gradient of h_0 into mtp_dh0_; beside the loss), or their
    // losses' (the gradients of h_1 .. h_D sent back to the MTP layers' stage), then the main
    // head's.
    if (ch.mtp) mtp_->backward(mtp_dh0_, loss_grad_scale);
    if (ch.stage.mtp_before) {
      for (int64_t j = mtp_loss_->depths() - 1; j >= 0; --j)
        mtp_loss_->backward(j, dstream_ + (j + 1) * n, loss_grad_scale);
    }
    ops::loss_grad_scale(ex, dloss_, member_ptr(io_.report, &ops::MicroBatchReport::counted),
                         loss_grad_scale);
    head_backward(dh0, h0, targets_T_, lse_T_, dloss_);
    if (ch.mtp) ops::add(ex, dh0, DevPtr<const T>(dh0), DevPtr<const T>(mtp_dh0_), n);
  } else {
    MOE_CHECK(doutput != nullptr, "[model] pipeline chunk {} needs its output gradient", c);
    if (ch.mtp) {
      // The gradients of h_1 .. h_D from the loss's stage through the depths, the one of h_0
      // added to theirs.
      mtp_->backward(mtp_dh0_, loss_grad_scale, doutput + n);
      ops::add(ex, dh0, doutput, DevPtr<const T>(mtp_dh0_), n);
    } else {
      ops::copy(ex, ch.final_norm ? dh0 : dstream_, doutput, ch.out_width * n);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    // The final norm's input kept as bf16: widened into its pass-through buffer (free now).
    if (ch.final_in16)
      ops::cast_bf16_to_f32(ex, ch.stream.back(), DevPtr<const bf16>(final_x16_), n);
  }
  if (ch.final_norm) final_norm_->backward(ex, dstream_, dfinal_, ch.stream.back(), T_local_);
  if (c == stage0_chunk_) stage_done(0);
  // This stage's copy of the table has its gradient (its stage is the embedding's).
  if (embedding_ == nullptr && shared_embedding() != nullptr && (ch.stage.loss || ch.mtp))
    stage_done(static_cast<int>(L) + 1);
  const RecomputeConfig& rc = cfg_.recompute;
  const int64_t first = ch.stage.first_layer, last = first + ch.stage.num_layers - 1;
  for (int64_t l = last; l >= first; --l) {
    const int64_t chunk = rc.chunk_of(l);
    if (chunk >= 0 && (l == last || rc.chunk_of(l + 1) != chunk)) {
      // Entering a recomputed chunk from its top: rerun its forward from the kept input (the
      // pipeline chunk's input at the latest).
      int64_t from = l;
      while (from > first && rc.chunk_of(from - 1) == chunk) --from;
      blocks_[ch.block_begin + from - first]->restore_input();  // bf16 residual: its input
      for (int64_t j = from; j <= l; ++j) {
        blocks_[ch.block_begin + j - first]->forward(ch.stream[j - first + 1],
                                                     ch.stream[j - first], /*recompute=*/true);
      }
    }
    blocks_[ch.block_begin + l - first]->backward(dstream_, dstream_, loss_grad_scale);
    stage_done(static_cast<int>(L - l));
  }
  if (microbatch >= 0) set_replay_micro_batch(c, -1);
  if (!ch.stage.embedding) return;
  embed_backward(*embedding_, dstream_, ids_T_, pos_embedding_ != nullptr ? pos_T_ : nullptr,
                 emb_drop_key_);
  stage_done(static_cast<int>(L) + 1);
}

template <typename T>
void GPTModel<T>::finish_step(const moe::RouterStepSync& sync) {
  params_.refresh_bf16();  // the optimizer changed the master weights
  for (TransformerBlock<T>* b : all_blocks_) {
    if (b->is_moe()) b->moe()->finish_step(sync);
  }
}

template <typename T>
void GPTModel<T>::set_training(bool training) {
  training_ = training;
  for (TransformerBlock<T>* b : all_blocks_) b->set_training(training);
}

template <typename T>
void GPTModel<T>::moe_stats(MoeStats* out) const {
  MoeStats& st = *out;
  st.num_moe_layers = 0;
  st.aux_value = st.aux_loss = st.z_loss = st.z_value = 0;
  for (double& v : st.lb_value) v = 0;
  st.dropped = 0;
  st.max_over_mean_load = 0;
  st.tokens_per_expert.assign(cfg_.num_experts, 0);
  size_t n_layers = 0;
  for (size_t l = 0; l < all_blocks_.size(); ++l) {
    const TransformerBlock<T>* b = all_blocks_[l];
    if (!b->is_moe()) continue;
    const auto& router = b->moe()->router();
    ++st.num_moe_layers;
    st.aux_value += router.aux_value();
    st.aux_loss += router.aux_loss();
    st.z_loss += router.z_loss();
    st.z_value += router.z_value();
    for (int i = 0; i < 3; ++i) st.lb_value[i] += router.lb_value(i);
    st.dropped += router.dropped();
    if (st.layers.size() <= n_layers) st.layers.emplace_back();  // the first call only
    MoeLayerStats& ls = st.layers[n_layers++];
    ls.layer = all_layers_[l];
    router.stats(&ls.router);
    for (int64_t e = 0; e < cfg_.num_experts; ++e)
      st.tokens_per_expert[e] += ls.router.tokens_per_expert[e];
    st.max_over_mean_load = std::max(st.max_over_mean_load, ls.router.max_over_mean_load);
  }
  st.layers.resize(n_layers);
}

template <typename T>
DevPtr<int32_t> GPTModel<T>::routing_table(const MicroBatchIO& io,
                                           const TransformerBlock<T>& b) const {
  if (io.routing_BSK == nullptr || !b.is_moe()) return nullptr;
  const auto it = routing_slot_.find(&b);
  MOE_CHECK(it != routing_slot_.end(), "[model] a MoE block outside the model's blocks");
  return io.routing_BSK + it->second * B_ * cfg_.seq_length * cfg_.moe.router.topk;
}

template <typename T>
void GPTModel<T>::routing_slots() {
  routing_slot_.clear();
  for (const TransformerBlock<T>* b : all_blocks_) {
    if (b->is_moe()) routing_slot_.emplace(b, static_cast<int64_t>(routing_slot_.size()));
  }
}

template <typename T>
std::vector<std::string> GPTModel<T>::routing_layers() const {
  std::vector<std::string> out;
  for (const TransformerBlock<T>* b : all_blocks_) {
    if (b->is_moe()) out.push_back(b->moe()->prefix());
  }
  return out;
}

template <typename T>
std::vector<const moe::Router<T>*> GPTModel<T>::routers() const {
  std::vector<const moe::Router<T>*> out;
  for (const TransformerBlock<T>* b : all_blocks_) {
    if (b->is_moe()) out.push_back(&b->moe()->router());
  }
  return out;
}

template <typename T>
std::vector<moe::Router<T>*> GPTModel<T>::routers() {
  std::vector<moe::Router<T>*> out;
  for (TransformerBlock<T>* b : all_blocks_) {
    if (b->is_moe()) out.push_back(&b->moe()->router());
  }
  return out;
}

template class GPTModel<float>;
template class GPTModel<double>;

}  // namespace moecore::model
