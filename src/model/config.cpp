#include "model/config.h"

#include <cctype>
#include <cmath>

#include "core/check.h"

namespace moecore {

const char* load_balancing_name(LoadBalancing lb) {
  switch (lb) {
    case LoadBalancing::None: return "none";
    case LoadBalancing::AuxLoss: return "aux_loss";
    case LoadBalancing::SeqAuxLoss: return "seq_aux_loss";
    case LoadBalancing::GlobalAuxLoss: return "global_aux_loss";
    case LoadBalancing::Sinkhorn: return "sinkhorn";
    case LoadBalancing::QuantileBalancing: return "quantile_balancing";
  }
  return "?";
}

const char* score_function_name(ScoreFunction s) {
  switch (s) {
    case ScoreFunction::Softmax: return "softmax";
    case ScoreFunction::Sigmoid: return "sigmoid";
    case ScoreFunction::SqrtSoftplus: return "sqrtsoftplus";
  }
  return "?";
}

const char* dispatcher_type_name(DispatcherType d) {
  switch (d) {
    case DispatcherType::AllGather: return "allgather";
    case DispatcherType::AlltoAll: return "alltoall";
  }
  return "?";
}

int64_t expert_capacity(int64_t n_tok, int64_t topk, int64_t num_experts,
                        double capacity_factor) {
  const double tokens = static_cast<double>(n_tok * topk);
  return static_cast<int64_t>(std::ceil(tokens / static_cast<double>(num_experts) * capacity_factor));
}

std::vector<LoadBalancingTerm> RouterConfig::load_balancing_terms() const {
  std::vector<LoadBalancingTerm> out{{load_balancing, aux_loss_coeff}};
  out.insert(out.end(), extra_load_balancing.begin(), extra_load_balancing.end());
  return out;
}

bool RouterConfig::uses(LoadBalancing type) const {
  for (const auto& t : load_balancing_terms()) {
    if (t.type == type) return true;
  }
  return false;
}

double RouterConfig::coeff(LoadBalancing type) const {
  for (const auto& t : load_balancing_terms()) {
    if (t.type == type) return t.coeff;
  }
  return 0.0;
}

void RouterConfig::validate() const {
  MOE_CHECK(num_experts >= 1, "[router] num_experts={} must be >= 1", num_experts);
  MOE_CHECK(topk >= 1 && topk <= num_experts,
            "[router] --moe-router-topk={} must be in [1, num_experts={}]", topk, num_experts);
  const bool sinkhorn = uses(LoadBalancing::Sinkhorn);
  const bool quantile = uses(LoadBalancing::QuantileBalancing);
  MOE_CHECK(sinkhorn || !(score == ScoreFunction::Softmax && !pre_softmax && topk == 1),
            "[router] softmax routing with --moe-router-topk=1 gives every token prob 1.0 and no "
            "router gradient: add --moe-router-pre-softmax");
  MOE_CHECK(z_loss_coeff >= 0, "[router] --moe-z-loss-coeff={} must be >= 0", z_loss_coeff);
  MOE_CHECK(topk_scaling_factor > 0, "[router] --moe-router-topk-scaling-factor={} must be > 0",
            topk_scaling_factor);

  // The load-balancing list: each type once, coefficients >= 0, loss-free types with coeff 0.
  const auto terms = load_balancing_terms();
  for (size_t i = 0; i < terms.size(); ++i) {
    const char* name = load_balancing_name(terms[i].type);
    MOE_CHECK(terms[i].coeff >= 0, "[router] --moe-aux-loss-coeff={} for {} must be >= 0",
              terms[i].coeff, name);
    for (size_t j = 0; j < i; ++j) {
      MOE_CHECK(terms[j].type != terms[i].type,
                "[router] --moe-router-load-balancing-type lists {} twice: give each type once",
                name);
    }
    const bool loss_free = terms[i].type == LoadBalancing::Sinkhorn ||
                           terms[i].type == LoadBalancing::QuantileBalancing;
    MOE_CHECK(!loss_free || terms[i].coeff == 0,
              "[router] {} balances without a loss but its --moe-aux-loss-coeff is {}: set that "
              "entry to 0",
              name, terms[i].coeff);
  }
  MOE_CHECK(!(sinkhorn && quantile),
            "[router] sinkhorn and quantile_balancing both choose the experts: pick one");

  if (sinkhorn) {
    MOE_CHECK(score == ScoreFunction::Softmax && !pre_softmax,
              "[router] sinkhorn routing uses its own activation (sigmoid for top-1, softmax "
              "otherwise): drop --moe-router-score-function {} / --moe-router-pre-softmax",
              score_function_name(score));
    MOE_CHECK(!group_limited() && !enable_expert_bias,
              "[router] sinkhorn routing selects by the Sinkhorn-balanced scores: it cannot be "
              "combined with --moe-router-group-topk or --moe-router-enable-expert-bias");
    MOE_CHECK(topk_scaling_factor == 1.0,
              "[router] Megatron's sinkhorn routing ignores --moe-router-topk-scaling-factor={}: "
              "remove it",
              topk_scaling_factor);
    MOE_CHECK(dropless(),
              "[router] --moe-expert-capacity-factor={} only works with aux_loss, seq_aux_loss, "
              "global_aux_loss or none load balancing (as in Megatron), not sinkhorn",
              capacity_factor);
  }
  if (quantile) {
    for (const auto& t : terms) {
      const bool aux = t.type == LoadBalancing::AuxLoss || t.type == LoadBalancing::SeqAuxLoss ||
                       t.type == LoadBalancing::GlobalAuxLoss;
      MOE_CHECK(!(aux && t.coeff > 0),
                "[router] quantile_balancing is loss-free: {} with --moe-aux-loss-coeff={} must "
                "be off (remove it or set its coeff to 0)",
                load_balancing_name(t.type), t.coeff);
    }
    MOE_CHECK(!group_limited(),
              "[router] quantile_balancing does not support group-limited routing "
              "(--moe-router-num-groups={}, --moe-router-group-topk={}): remove those flags",
              num_groups, group_topk);
    MOE_CHECK(!enable_expert_bias,
              "[router] quantile_balancing and --moe-router-enable-expert-bias both offset the "
              "selection: pick one");
    MOE_CHECK(topk < num_experts,
              "[router] quantile_balancing needs the (K+1)-th largest score: "
              "--moe-router-topk={} must be < num_experts={}",
              topk, num_experts);
    MOE_CHECK(quantile_ema >= 0 && quantile_ema < 1,
              "[router] --moe-router-quantile-balancing-ema={} must be in [0, 1)", quantile_ema);
  }

  MOE_CHECK((num_groups > 0) == (group_topk > 0),
            "[router] group-limited routing needs both --moe-router-num-groups and "
            "--moe-router-group-topk (got {} and {})",
            num_groups, group_topk);
  if (group_limited()) {
    MOE_CHECK(num_experts % num_groups == 0,
              "[router] --moe-router-num-groups={} must divide num_experts={}", num_groups,
              num_experts);
    MOE_CHECK(group_topk <= num_groups,
              "[router] --moe-router-group-topk={} must be <= --moe-router-num-groups={}",
              group_topk, num_groups);
    MOE_CHECK(topk % group_topk == 0,
              "[router] --moe-router-topk={} must be divisible by --moe-router-group-topk={} "
              "(each chosen group contributes topk/group_topk experts to its score)",
              topk, group_topk);
    MOE_CHECK(num_experts / num_groups >= topk / group_topk,
              "[router] each group has {} experts but the group score needs topk/group_topk={}: "
              "use fewer groups or a larger --moe-router-group-topk",
              num_experts / num_groups, topk / group_topk);
  }
  if (enable_expert_bias) {
    MOE_CHECK(score == ScoreFunction::Sigmoid || score == ScoreFunction::SqrtSoftplus,
              "[router] --moe-router-enable-expert-bias needs --moe-router-score-function "
              "sigmoid or sqrtsoftplus (got {})",
              score_function_name(score));
    MOE_CHECK(bias_update_rate >= 0, "[router] --moe-router-bias-update-rate={} must be >= 0",
              bias_update_rate);
  }
  MOE_CHECK(input_jitter_eps >= 0 && input_jitter_eps < 1,
            "[router] --moe-input-jitter-eps={} must be in [0, 1)", input_jitter_eps);
  MOE_CHECK(!pad_to_capacity || !dropless(),
            "[router] --moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor > 0");
}

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

RecomputeModules RecomputeConfig::modules() const {
  RecomputeModules m;
  if (!selective()) return m;
  for (const std::string& name : module_names) {
    if (name == "core_attn") m.core_attn = true;
    else if (name == "layernorm") m.layernorm = true;
    else if (name == "moe_act") m.moe_act = true;
    else if (name == "moe") m.moe = true;
    else if (name == "shared_experts") m.shared_experts = true;
    else if (name == "mlp") m.mlp = true;
  }
  return m;
}

int64_t RecomputeConfig::chunk_of(int64_t layer) const {
  if (!full()) return -1;
  if (method == RecomputeMethod::Uniform) return layer / num_layers;
  return layer < num_layers ? layer : -1;  // block
}

void RecomputeConfig::validate(int64_t model_layers) const {
  if (granularity == RecomputeGranularity::None) {
    MOE_CHECK(method == RecomputeMethod::None && num_layers == 0,
              "[model] --recompute-method / --recompute-num-layers need "
              "--recompute-granularity full");
    return;
  }
  if (full()) {
    MOE_CHECK(method != RecomputeMethod::None,
              "[model] --recompute-granularity full needs --recompute-method uniform or block");
    MOE_CHECK(num_layers >= 1 && num_layers <= model_layers,
              "[model] --recompute-num-layers={} must be between 1 and --num-layers={} with "
              "--recompute-granularity full",
              num_layers, model_layers);
    return;
  }
  MOE_CHECK(method == RecomputeMethod::None && num_layers == 0,
            "[model] --recompute-method and --recompute-num-layers apply to "
            "--recompute-granularity full only; selective recomputation takes "
            "--recompute-modules");
  MOE_CHECK(!module_names.empty(),
            "[model] --recompute-granularity selective with no --recompute-modules");
  for (const std::string& name : module_names) {
    MOE_CHECK(name != "mla_up_proj",
              "[model] --recompute-modules mla_up_proj: multi-latent attention is not "
              "implemented");
    MOE_CHECK(name == "core_attn" || name == "layernorm" || name == "moe_act" || name == "moe" ||
                  name == "shared_experts" || name == "mlp",
              "[model] unknown --recompute-modules entry '{}': choose from core_attn, layernorm, "
              "moe_act, moe, shared_experts, mlp",
              name);
  }
}

void ModelConfig::validate() const {
  MOE_CHECK(vocab_size >= 2 && hidden >= 1 && num_layers >= 1 && seq_length >= 1,
            "[model] sizes must be positive (vocab={}, hidden={}, layers={}, seq={})", vocab_size,
            hidden, num_layers, seq_length);
  MOE_CHECK(num_heads >= 1 && (kv_channels > 0 || hidden % num_heads == 0),
            "[model] --num-attention-heads={} does not divide --hidden-size={}: pick a divisor "
            "or set --kv-channels",
            num_heads, hidden);
  MOE_CHECK(num_query_groups >= 1 && num_heads % num_query_groups == 0,
            "[model] --num-query-groups={} must divide --num-attention-heads={}",
            num_query_groups, num_heads);
  MOE_CHECK(head_dim() % 2 == 0, "[model] head dim {} must be even for RoPE", head_dim());
  MOE_CHECK(max_positions() >= seq_length,
            "[model] --max-position-embeddings={} < --seq-length={}", max_positions(),
            seq_length);
  MOE_CHECK(num_experts >= 0, "[model] --num-experts={} must be >= 0", num_experts);
  MOE_CHECK(moe_layer_pattern.empty() ||
                static_cast<int64_t>(moe_layer_pattern.size()) == num_layers,
            "[model] --moe-layer-freq lists {} layers but --num-layers={}",
            moe_layer_pattern.size(), num_layers);
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
    MOE_CHECK(moe.shared_ffn_hidden >= 0,
              "[model] --moe-shared-expert-intermediate-size={} must be >= 0",
              moe.shared_ffn_hidden);
  }
  recompute.validate(num_layers);
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
