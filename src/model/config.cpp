#include "model/config.h"

#include <algorithm>

#include <cctype>
#include <cmath>

#include "core/check.h"
#include "ops/step_report.h"

namespace moecore {

double ModelConfig::output_init_std() const {
  return init_std / std::sqrt(2.0 * static_cast<double>(num_layers));
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  if (moe_layer_pattern.empty()) return true;
  return moe_layer_pattern[layer] != 0;
}

bool ModelConfig::has_dense_layer() const {
  for (int64_t l = 0; l < num_layers; ++l) {
    if (!is_moe_layer(l)) return true;
  }
  return false;
}

MoeLayerConfig ModelConfig::moe_layer() const {
  MoeLayerConfig c;
  c.hidden = hidden;
  c.num_experts = num_experts;
  c.seq_length = seq_length;
  c.init_std = init_std;
  c.output_init_std = output_init_std();
  c.moe = moe;
  c.recompute = recompute.modules();
  c.activation = activation;
  c.add_mlp_bias = add_mlp_bias;
  return c;
}

double ModelConfig::min_params_per_rank(int64_t ep) const {
  const double h = static_cast<double>(hidden), d = static_cast<double>(head_dim());
  const double attention = h * d * static_cast<double>(2 * num_heads + 2 * num_query_groups);
  const int64_t moe_layers =
      num_experts == 0          ? 0
      : moe_layer_pattern.empty() ? num_layers
                                  : std::count(moe_layer_pattern.begin(), moe_layer_pattern.end(), 1);
  const double experts_mlp = 2.0 * h * static_cast<double>(moe.ffn_hidden) *
                             static_cast<double>(num_experts) / static_cast<double>(ep);
  const double dense_mlp = 2.0 * h * static_cast<double>(ffn_hidden);
  const double positions = position_embedding == PositionEmbedding::LearnedAbsolute
                               ? static_cast<double>(max_positions()) * h
                               : 0.0;
  return static_cast<double>(padded_vocab()) * h + positions +
         static_cast<double>(num_layers) * attention +
         static_cast<double>(moe_layers) * experts_mlp +
         static_cast<double>(num_layers - moe_layers) * dense_mlp;
}

void ModelConfig::validate() const {
  MOE_CHECK(vocab_size >= 2 && hidden >= 1 && num_layers >= 1 && seq_length >= 1,
            "[model] sizes must be positive (vocab={}, hidden={}, layers={}, seq={})", vocab_size,
            hidden, num_layers, seq_length);
  MOE_CHECK(padded_vocab_size == 0 || padded_vocab_size >= vocab_size,
            "[model] the padded vocabulary {} is smaller than the vocabulary {}: the embedding "
            "and the output head need a row per token (the padding adds rows, never removes "
            "them)",
            padded_vocab_size, vocab_size);
  MOE_CHECK(num_heads >= 1 && (kv_channels > 0 || hidden % num_heads == 0),
            "[model] --num-attention-heads={} does not divide --hidden-size={}: pick a divisor "
            "or set --kv-channels",
            num_heads, hidden);
  MOE_CHECK(num_query_groups >= 1 && num_heads % num_query_groups == 0,
            "[model] --num-query-groups={} must divide --num-attention-heads={}: give "
            "--num-query-groups a divisor of {} (or drop --group-query-attention), or change "
            "--num-attention-heads",
            num_query_groups, num_heads, num_heads);
  MOE_CHECK(position_embedding != PositionEmbedding::Rope || multi_latent_attention ||
                head_dim() % 2 == 0,
            "[model] head dim {} must be even for RoPE", head_dim());
  MOE_CHECK(!qk_layernorm || normalization == Normalization::RMSNorm,
            "[model] --qk-layernorm normalizes q and k with RMSNorm here; with --normalization "
            "LayerNorm it is not implemented yet: remove --qk-layernorm or use --normalization "
            "RMSNorm");
  MOE_CHECK(!layernorm_1p || normalization == Normalization::LayerNorm,
            "[model] --apply-layernorm-1p is LayerNorm's: use --normalization LayerNorm");
  MOE_CHECK(norm_eps > 0, "[model] --norm-epsilon={} must be > 0 (the norms divide by "
                          "sqrt(variance + epsilon))",
            norm_eps);
  for (auto [p, flag] : {std::pair{hidden_dropout, "--hidden-dropout"},
                         std::pair{attention_dropout, "--attention-dropout"}}) {
    MOE_CHECK(p >= 0 && p < 1, "[model] {}={} must be in [0, 1)", flag, p);
  }
  MOE_CHECK(max_positions() >= seq_length,
            "[model] --max-position-embeddings={} < --seq-length={}: raise "
            "--max-position-embeddings to {} or lower --seq-length to {}",
            max_positions(), seq_length, seq_length, max_positions());
  MOE_CHECK(num_experts >= 0, "[model] --num-experts={} must be >= 0", num_experts);
  MOE_CHECK(moe_layer_pattern.empty() ||
                static_cast<int64_t>(moe_layer_pattern.size()) == num_layers,
            "[model] --moe-layer-freq lists {} layers but --num-layers={}: give one 0/1 entry "
            "per layer, or --num-layers {}",
            moe_layer_pattern.size(), num_layers, moe_layer_pattern.size());
  if (has_dense_layer()) {
    MOE_CHECK(ffn_hidden >= 1, "[model] dense layers need --ffn-hidden-size >= 1 (got {})",
              ffn_hidden);
  }
  if (num_experts > 0) {
    MOE_CHECK(moe.router.num_experts == num_experts,
              "[model] router has {} experts, model {}", moe.router.num_experts, num_experts);
    moe.router.validate();
    MOE_CHECK(moe.ffn_hidden >= 1, "[model] --moe-ffn-hidden-size={} must be >= 1",
              moe.ffn_hidden);
  }
  MOE_CHECK(mtp_num_layers >= 0 && mtp_num_layers <= ops::kMaxMtpDepths,
            "[model] --mtp-num-layers={} must be in [0, {}] (the step report's room for the "
            "depths' losses)",
            mtp_num_layers, ops::kMaxMtpDepths);
  MOE_CHECK(std::isfinite(mtp_loss_scaling_factor),
            "[model] --mtp-loss-scaling-factor={} must be a finite number",
            mtp_loss_scaling_factor);
  moe.validate();  // also for dense models: a shared-expert gate without a shared expert
  recompute.validate(num_layers);
  MOE_CHECK(!recompute.modules().mla_up_proj || multi_latent_attention,
            "[model] --recompute-modules mla_up_proj recomputes multi-latent attention's up "
            "projections: give --multi-latent-attention, or drop mla_up_proj");
  if (multi_latent_attention) mla.validate();
}

void MlaConfig::validate() const {
  MOE_CHECK(q_lora_rank >= 0,
            "[model] --q-lora-rank={} must be >= 1, or omitted for a direct q projection",
            q_lora_rank);
  MOE_CHECK(kv_lora_rank >= 1, "[model] --kv-lora-rank={} must be >= 1 (Megatron's default: 32)",
            kv_lora_rank);
  MOE_CHECK(qk_head_dim >= 1 && v_head_dim >= 1,
            "[model] --qk-head-dim={} and --v-head-dim={} must be >= 1 (Megatron's defaults: "
            "128)",
            qk_head_dim, v_head_dim);
  MOE_CHECK(qk_pos_emb_head_dim >= 2 && qk_pos_emb_head_dim % 2 == 0,
            "[model] --qk-pos-emb-head-dim={} must be even and >= 2: RoPE rotates pairs of it "
            "(Megatron's default: 64)",
            qk_pos_emb_head_dim);
  if (rope_type == ops::RopeType::Yarn) {
    MOE_CHECK(yarn.scaling_factor > 0,
              "[model] --rotary-scaling-factor={} must be > 0 (1: no YaRN scaling)",
              yarn.scaling_factor);
    MOE_CHECK(yarn.original_max_position_embeddings >= 1,
              "[model] --yarn-original-max-position-embeddings={} must be >= 1 (omitted: 4096)",
              yarn.original_max_position_embeddings);
    MOE_CHECK(yarn.beta_fast > 0 && yarn.beta_slow > 0,
              "[model] --yarn-beta-fast={} and --yarn-beta-slow={} must be > 0 (omitted: 32 "
              "and 1)",
              yarn.beta_fast, yarn.beta_slow);
  }
}

std::vector<int> parse_moe_layer_freq(const std::string& spec, int64_t num_layers) {
  std::string s;
  for (char c : spec) {
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  }
  MOE_CHECK(!s.empty(), "[model] empty --moe-layer-freq");
  std::vector<int> out;
  if (std::isdigit(static_cast<unsigned char>(s[0]))) {
    int n = std::stoi(s);
    MOE_CHECK(n >= 1, "[model] --moe-layer-freq={} must be >= 1", n);
    for (int64_t i = 0; i < num_layers; ++i) out.push_back(i % n == 0 ? 1 : 0);
    return out;
  }
  // Terms joined by '+': "[a,b,...]" optionally followed by "*count"; outer parens allowed.
  if (s.front() == '(' && s.back() == ')') s = s.substr(1, s.size() - 2);
  size_t pos = 0;
  while (pos < s.size()) {
    MOE_CHECK(s[pos] == '[', "[model] cannot parse --moe-layer-freq '{}': expected '[' at {}",
              spec, pos);
    size_t close = s.find(']', pos);
    MOE_CHECK(close != std::string::npos, "[model] unbalanced '[' in --moe-layer-freq '{}'", spec);
    std::vector<int> items;
    size_t i = pos + 1;
    while (i < close) {
      size_t comma = s.find(',', i);
      if (comma == std::string::npos || comma > close) comma = close;
      std::string tok = s.substr(i, comma - i);
      MOE_CHECK(tok == "0" || tok == "1", "[model] --moe-layer-freq entries must be 0 or 1, got '{}'",
                tok);
      items.push_back(tok == "1");
      i = comma + 1;
    }
    pos = close + 1;
    int reps = 1;
    if (pos < s.size() && s[pos] == '*') {
      size_t end = pos + 1;
      while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
      MOE_CHECK(end > pos + 1, "[model] expected a count after '*' in --moe-layer-freq '{}'", spec);
      reps = std::stoi(s.substr(pos + 1, end - pos - 1));
      pos = end;
    }
    for (int r = 0; r < reps; ++r) out.insert(out.end(), items.begin(), items.end());
    if (pos < s.size()) {
      MOE_CHECK(s[pos] == '+', "[model] cannot parse --moe-layer-freq '{}' at {}", spec, pos);
      ++pos;
    }
  }
  MOE_CHECK(static_cast<int64_t>(out.size()) == num_layers,
            "[model] --moe-layer-freq '{}' has {} entries but --num-layers={}", spec, out.size(),
            num_layers);
  return out;
}

}  // namespace moecore
