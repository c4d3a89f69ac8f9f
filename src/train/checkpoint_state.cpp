#include "train/checkpoint_state.h"

#include <fmt/format.h>

#include "core/check.h"

namespace moecore::train {

using nlohmann::json;

namespace {
// The signature key of checkpoints whose model included the vocabulary padding.
constexpr const char* kOldPaddedVocabKey = "--vocab-size (padded)";
}  // namespace

json model_signature(const ModelConfig& m) {
  json moe_layers = json::array();
  for (int64_t l = 0; l < m.num_layers; ++l) moe_layers.push_back(m.is_moe_layer(l) ? 1 : 0);
  return {
      {"--num-layers", m.num_layers},
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
      {"--position-embedding-type", m.position_embedding == PositionEmbedding::Rope ? "rope"
                                    : m.position_embedding == PositionEmbedding::LearnedAbsolute
                                        ? "learned_absolute"
                                        : "none"},
      {"--swiglu / --openai-gelu / --squared-relu (the MLP activation)",
       ops::activation_name(m.activation)},
      {"--disable-bias-linear (MLP biases)", !m.add_mlp_bias},
      {"--untie-embeddings-and-output-weights", !m.tie_embeddings}};
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

bool tp_first_holder(const ParamSpec& p, const HolderRanks& r) {
  return p.tp_role == TpRole::Sharded || (p.kind == ParamKind::Dense ? r.tp : r.expt_tp) == 0;
}

bool first_holder(const ParamSpec& p, const HolderRanks& r) {
  return (p.kind == ParamKind::Dense ? r.dp_cp : r.expt_dp) == 0 && tp_first_holder(p, r);
}

std::vector<float> assembly_buffer(int64_t numel) {
  return std::vector<float>(static_cast<size_t>(numel), -0.0f);
}

}  // namespace moecore::train
