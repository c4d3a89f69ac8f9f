#include "moe/config.h"

#include <cmath>

#include "core/check.h"

namespace moecore {

const char* load_balancing_name(LoadBalancing lb) {
  switch (lb) {
    case LoadBalancing::None:
      return "none";
    case LoadBalancing::AuxLoss:
      return "aux_loss";
    case LoadBalancing::SeqAuxLoss:
      return "seq_aux_loss";
    case LoadBalancing::GlobalAuxLoss:
      return "global_aux_loss";
    case LoadBalancing::Sinkhorn:
      return "sinkhorn";
    case LoadBalancing::QuantileBalancing:
      return "quantile_balancing";
  }
  return "?";
}

const char* score_function_name(ScoreFunction s) {
  switch (s) {
    case ScoreFunction::Softmax:
      return "softmax";
    case ScoreFunction::Sigmoid:
      return "sigmoid";
    case ScoreFunction::SqrtSoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}

const char* dispatcher_type_name(DispatcherType d) {
  switch (d) {
    case DispatcherType::AllGather:
      return "allgather";
    case DispatcherType::AlltoAll:
      return "alltoall";
  }
  return "?";
}

int64_t expert_capacity(int64_t n_tok, int64_t topk, int64_t num_experts, double capacity_factor) {
  const double tokens = static_cast<double>(n_tok * topk);
  return static_cast<int64_t>(
      std::ceil(tokens / static_cast<double>(num_experts) * capacity_factor));
}

std::vector<LoadBalancingTerm> RouterConfig::load_balancing_terms() const {
  std::vector<LoadBalancingTerm> out{{load_balancing, aux_loss_coeff}};
  out.insert(out.end(), extra_load_balancing.begin(), extra_load_balancing.end());
  return out;
}

// Both read the listed terms in place (the router asks inside a step, which allocates nothing).
bool RouterConfig::uses(LoadBalancing type) const {
  if (load_balancing == type) return true;
  for (const auto& t : extra_load_balancing) {
    if (t.type == type) return true;
  }
  return false;
}

double RouterConfig::coeff(LoadBalancing type) const {
  if (load_balancing == type) return aux_loss_coeff;
  for (const auto& t : extra_load_balancing) {
    if (t.type == type) return t.coeff;
  }
  return 0.0;
}

void MoeConfig::validate() const {
  MOE_CHECK(shared_ffn_hidden >= 0, "[moe] --moe-shared-expert-intermediate-size={} must be >= 0",
            shared_ffn_hidden);
  MOE_CHECK(
      !shared_expert_gate || shared_ffn_hidden > 0,
      "[moe] --moe-shared-expert-gate gates the shared expert, but there is none "
      "(--moe-shared-expert-intermediate-size={}): give --moe-shared-expert-intermediate-size "
      "N > 0 or remove --moe-shared-expert-gate",
      shared_ffn_hidden);
  // Megatron's TransformerConfig refuses the pair too: the allgather dispatcher's collectives
  // are not split around the shared expert.
  MOE_CHECK(!shared_expert_overlap || shared_ffn_hidden == 0 ||
                dispatcher_type == DispatcherType::AlltoAll,
            "[moe] --moe-shared-expert-overlap computes the shared expert (width {}) while the "
            "alltoall dispatcher's all-to-alls are in flight; --moe-token-dispatcher-type {} has "
            "none (Megatron refuses the pair too): give --moe-token-dispatcher-type alltoall "
            "(the same model) or drop --moe-shared-expert-overlap",
            shared_ffn_hidden, dispatcher_type_name(dispatcher_type));
  const double f = expert_rank_capacity_factor;
  MOE_CHECK(
      f == 0 || f >= 1,
      "[dispatcher] --moe-expert-rank-capacity-factor {} < 1: dropless, the EP ranks together "
      "receive EP x T x K rows, so some rank always gets at least its balanced T x K; give "
      "a factor >= 1 (the headroom over the balanced load, e.g. 1.5) or leave the flag out",
      f);
  MOE_CHECK(f == 0 || !router.pad_to_capacity,
            "[dispatcher] --moe-expert-rank-capacity-factor {} with "
            "--moe-pad-expert-input-to-capacity: padded dispatch already has static rows (EP x "
            "local experts x capacity); drop one of the two flags",
            f);
}

void RouterConfig::validate() const {
  MOE_CHECK(num_experts >= 1, "[router] num_experts={} must be >= 1", num_experts);
  MOE_CHECK(topk >= 1 && topk <= num_experts,
            "[router] --moe-router-topk={} must be in [1, num_experts={}]: lower "
            "--moe-router-topk to at most {} or raise --num-experts to at least {}",
            topk, num_experts, num_experts, topk);
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
              "--moe-router-topk={} must be < num_experts={}: lower --moe-router-topk to at "
              "most {} or raise --num-experts",
              topk, num_experts, num_experts - 1);
    MOE_CHECK(quantile_ema >= 0 && quantile_ema < 1,
              "[router] --moe-router-quantile-balancing-ema={} must be in [0, 1)", quantile_ema);
  }

  MOE_CHECK((num_groups > 0) == (group_topk > 0),
            "[router] group-limited routing needs both --moe-router-num-groups and "
            "--moe-router-group-topk (got {} and {})",
            num_groups, group_topk);
  if (group_limited()) {
    MOE_CHECK(num_experts % num_groups == 0,
              "[router] --moe-router-num-groups={} must divide num_experts={}: give "
              "--moe-router-num-groups a divisor of {}",
              num_groups, num_experts, num_experts);
    MOE_CHECK(group_topk <= num_groups,
              "[router] --moe-router-group-topk={} must be <= --moe-router-num-groups={}: lower "
              "--moe-router-group-topk to at most {} or raise --moe-router-num-groups",
              group_topk, num_groups, num_groups);
    MOE_CHECK(topk % group_topk == 0,
              "[router] --moe-router-topk={} must be divisible by --moe-router-group-topk={} "
              "(each chosen group contributes topk/group_topk experts to its score): give "
              "--moe-router-group-topk a divisor of {}",
              topk, group_topk, topk);
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
  MOE_CHECK(capacity_groups >= 1, "[router] capacity_groups={} must be >= 1", capacity_groups);
  // Padding fills each expert to one group's capacity: with several groups an expert may keep
  // more rows than that.
  MOE_CHECK(capacity_groups == 1 || !pad_to_capacity,
            "[router] capacity_groups={} with --moe-pad-expert-input-to-capacity: padding "
            "needs one capacity group",
            capacity_groups);
}

}  // namespace moecore
