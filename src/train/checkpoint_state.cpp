#include "train/checkpoint_state.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/shape.h"

namespace moecore::train {

using nlohmann::json;

namespace {
// The signature key of checkpoints whose model included the vocabulary padding.
constexpr const char* kOldPaddedVocabKey = "--vocab-size (padded)";

// What the routers compute with the same router weights: which experts a token takes and with
// what weight (docs/router.md). A model trained under one routing and loaded or exported under
// another computes something else, so these are part of the model like its shapes. Training-only
// settings (the aux-loss coefficients and kinds, z-loss, jitter, the bias update rate, the
// quantile EMA, capacity and dispatch) are not: a run may change them on resume.
void add_router_signature(const RouterConfig& r, json& sig) {
  sig["--moe-router-topk"] = r.topk;
  sig["--moe-router-score-function"] = score_function_name(r.score);
  sig["--moe-router-pre-softmax"] = r.pre_softmax;
  sig["--moe-router-topk-scaling-factor"] = r.topk_scaling_factor;
  sig["--moe-router-num-groups"] = r.num_groups;
  sig["--moe-router-group-topk"] = r.group_topk;
  sig["--moe-router-enable-expert-bias"] = r.enable_expert_bias;
  // Of the balancing types, those that choose the experts: Sinkhorn's balanced scores and
  // quantile balancing's offsets; the loss types (and none) route by the plain top-k.
  sig["--moe-router-load-balancing-type (how experts are chosen)"] =
      r.uses(LoadBalancing::Sinkhorn)            ? "sinkhorn"
      : r.uses(LoadBalancing::QuantileBalancing) ? "quantile_balancing"
                                                 : "top-k of the scores (aux_loss, seq_aux_loss, "
                                                   "global_aux_loss or none)";
}

}  // namespace

json model_signature(const ModelConfig& m) {
  json moe_layers = json::array();
  for (int64_t l = 0; l < m.num_layers; ++l) moe_layers.push_back(m.is_moe_layer(l) ? 1 : 0);
  json sig = {{"--num-layers", m.num_layers},
          {"--hidden-size", m.hidden},
          {"--ffn-hidden-size", m.ffn_hidden},
          {"--num-attention-heads", m.num_heads},
          {"--num-query-groups", m.num_query_groups},
          {"--kv-channels", m.head_dim()},
          // The model's vocabulary, not the padded one: the padding depends on the TP size and
          // is not part of the model, so checkpoints of every TP size are the same model.
          {"--vocab-size", m.vocab_size},
          {"--num-experts", m.num_experts},
          {"--moe-ffn-hidden-size", m.moe.ffn_hidden},
          {"--moe-shared-expert-intermediate-size", m.moe.shared_ffn_hidden},
          {"--moe-shared-expert-gate", m.moe.shared_expert_gate},
          {"--moe-layer-freq", m.num_experts > 0 ? moe_layers : json::array()},
          {"--add-qkv-bias", m.add_qkv_bias},
          {"--add-attention-output-bias", m.add_attention_output_bias},
          {"--qk-layernorm", m.qk_layernorm},
          // What the layers compute with the same tensors' shapes can differ too.
          {"--normalization", m.normalization == Normalization::LayerNorm ? "LayerNorm" : "RMSNorm"},
          {"--apply-layernorm-1p", m.layernorm_1p},
          {"--position-embedding-type",
           m.position_embedding == PositionEmbedding::Rope              ? "rope"
           : m.position_embedding == PositionEmbedding::LearnedAbsolute ? "learned_absolute"
                                                                        : "none"},
          {"--swiglu / --openai-gelu / --squared-relu (the MLP activation)",
           ops::activation_name(m.activation)},
          {"--disable-bias-linear (MLP biases)", !m.add_mlp_bias},
          {"--untie-embeddings-and-output-weights", !m.tie_embeddings},
          {"--mtp-num-layers (multi-token prediction depths)", m.mtp_num_layers}};
  // Multi-latent attention replaces the QKV projection: its ranks and head dims are the
  // attention's shapes, and kv_channels / num_query_groups are not read (so not compared: a run
  // may leave them at any value). Checkpoints written before these keys compare what they hold.
  sig["--multi-latent-attention"] = m.multi_latent_attention;
  if (m.multi_latent_attention) {
    sig.erase("--kv-channels");
    sig.erase("--num-query-groups");
    sig["--q-lora-rank (0: a direct q projection)"] = m.mla.q_lora_rank;
    sig["--kv-lora-rank"] = m.mla.kv_lora_rank;
    sig["--qk-head-dim"] = m.mla.qk_head_dim;
    sig["--qk-pos-emb-head-dim"] = m.mla.qk_pos_emb_head_dim;
    sig["--v-head-dim"] = m.mla.v_head_dim;
  }
  // A dense model has no router (and a dense checkpoint records none, so that
  // --moe-use-upcycling compares nothing of it).
  if (m.num_experts > 0) add_router_signature(m.moe.router, sig);
  return sig;
}

void check_same_model(const json& saved, const json& mine, const std::string& dir) {
  // Written before the padding left the model: its padded rows were logits of its softmax and
  // were trained, so it is another model than any this build makes of its flags.
  if (saved.contains(kOldPaddedVocabKey) && !saved.contains("--vocab-size")) {
    MOE_FAIL(
        "[checkpoint] '{}' records the padded vocabulary ({} = {}): it was written when the "
        "vocabulary padding took part in the softmax (as in Megatron), so its padded rows "
        "were trained as logits. This moecore keeps the padding out of the model (the "
        "signature records --vocab-size, the model's vocabulary, {} here), so that "
        "checkpoint holds another model and cannot load: train it again with this build, "
        "or convert it with the moecore that wrote it",
        dir, kOldPaddedVocabKey, saved[kOldPaddedVocabKey].dump(),
        mine.contains("--vocab-size") ? mine["--vocab-size"].dump() : "unknown");
  }
  std::string diff;
  for (const auto& [flag, value] : mine.items()) {
    if (!saved.contains(flag)) continue;
    if (saved[flag] != value) {
      diff += fmt::format("\n  {}: {} in the checkpoint, {} in this run", flag, saved[flag].dump(),
                          value.dump());
    }
  }
  MOE_CHECK(diff.empty(),
            "[checkpoint] '{}' holds another model:{}\nA checkpoint loads into the model that "
            "wrote it, in any layout: give these flags the checkpoint's values",
            dir, diff);
}

ckpt::SliceRef checkpoint_slice(const ParamSlice& s, std::string file) {
  ckpt::SliceRef r{std::move(file)};
  if (s.whole()) return r;
  r.dim = s.dim;
  r.offset = s.offset;
  r.length = s.length;
  r.parts = s.parts;
  if (s.second.split()) {
    r.second = {s.second.dim, s.second.offset, s.second.length, s.second.parts};
  }
  return r;
}

std::vector<int64_t> slice_shape(const std::vector<int64_t>& global_shape, const ParamSlice& s) {
  std::vector<int64_t> out = global_shape;
  if (s.dim >= 0) out[s.dim] = s.first().local_extent();
  if (s.second.split()) out[s.second.dim] = s.second.local_extent();
  return out;
}

std::vector<int64_t> checkpoint_shape(const ParamSpec& p) {
  std::vector<int64_t> shape = p.global_shape;
  if (!shape.empty()) shape[0] = p.model_extent0();
  return shape;
}

CheckpointPiece slice_piece(const ParamSpec& p) {
  const std::vector<int64_t> local = slice_shape(p.global_shape, p.slice);
  CheckpointPiece out{checkpoint_slice(p.slice), 0, shape_numel(local)};
  if (p.global_shape.empty() || p.model_extent0() == p.global_shape[0]) return out;
  MOE_CHECK(p.model_rows >= 0 && p.model_rows <= p.global_shape[0],
            "[checkpoint] '{}' has {} model rows of {}", p.name, p.model_rows, p.global_shape[0]);
  int64_t row = 1;  // local elements per row of dimension 0
  for (size_t d = 1; d < local.size(); ++d) row *= local[d];
  if (p.slice.dim != 0) {  // dimension 0 whole here: the model rows are the first rows
    out.count = p.model_rows * row;
    return out;
  }
  MOE_CHECK(p.slice.parts == 1,
            "[checkpoint] '{}' is split along dimension 0 in {} parts and has padding rows past "
            "its {} model rows: a checkpoint cannot clip such a slice to the model rows",
            p.name, p.slice.parts, p.model_rows);
  const int64_t end = std::min(p.slice.offset + p.slice.length, p.model_rows);
  const int64_t rows = std::max<int64_t>(0, end - p.slice.offset);
  out.slice.length = rows;
  out.count = rows * row;
  if (rows == 0) out.slice.offset = std::min(p.slice.offset, p.model_rows);
  return out;
}

CheckpointPiece owned_piece(const ParamSpec& p, int64_t begin, int64_t count) {
  const CheckpointPiece whole = slice_piece(p);  // its count: the local model elements
  const int64_t n = std::max<int64_t>(0, std::min(count, whole.count - begin));
  if (!p.slice.contiguous()) {
    CheckpointPiece out{whole.slice, begin, n};
    out.slice.range = {std::min(begin, whole.count), n};
    return out;
  }
  // One run of the flattened tensor: where the local elements start in it.
  int64_t base = 0;
  if (p.slice.dim == 0) {
    base = p.slice.offset;
    for (size_t d = 1; d < p.global_shape.size(); ++d) base *= p.global_shape[d];
  }
  return {ckpt::SliceRef{"", ckpt::SliceRef::kFlat, base + begin, n}, begin, n};
}

bool writes_slice(const ParamSpec& p, int index, const HolderRanks& r) {
  if (p.pipeline_copy) return false;  // the first stage writes the table
  const bool dense = p.kind == ParamKind::Dense;
  const bool over_tp = p.tp_role != TpRole::Sharded;  // identical on every (expert) TP rank
  const int tp = dense ? r.tp : r.expt_tp, tp_size = dense ? r.tp_size : r.expt_tp_size;
  const int dp = dense ? r.dp_cp : r.expt_dp, dp_size = dense ? r.dp_cp_size : r.expt_dp_size;
  const int copies = dp_size * (over_tp ? tp_size : 1);
  const int mine = over_tp ? dp * tp_size + tp : dp;
  // Which distinct slice this is, so that the slices of one parameter fall on different copies.
  const int distinct = (dense ? 0 : r.ep * (over_tp ? 1 : tp_size)) + (over_tp ? 0 : tp);
  return mine == (index + distinct) % copies;
}

bool writes_owned_pieces(const ParamSpec& p, int index, const HolderRanks& r) {
  if (p.pipeline_copy) return false;
  if (p.tp_role == TpRole::Sharded) return true;
  const bool dense = p.kind == ParamKind::Dense;
  return (dense ? r.tp : r.expt_tp) == index % (dense ? r.tp_size : r.expt_tp_size);
}

bool writes_replicated(int index, const HolderRanks& r) {
  return r.world == index % r.world_size;
}

}  // namespace moecore::train
