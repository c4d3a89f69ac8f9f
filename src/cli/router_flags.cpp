#include <CLI/CLI.hpp>

#include "cli/router_flags.h"

#include "core/check.h"

namespace moecore::cli {

namespace {

LoadBalancing parse_load_balancing(const std::string& s) {
  if (s == "aux_loss") return LoadBalancing::AuxLoss;
  if (s == "seq_aux_loss") return LoadBalancing::SeqAuxLoss;
  if (s == "global_aux_loss") return LoadBalancing::GlobalAuxLoss;
  if (s == "sinkhorn") return LoadBalancing::Sinkhorn;
  if (s == "quantile_balancing") return LoadBalancing::QuantileBalancing;
  if (s == "none") return LoadBalancing::None;
  MOE_FAIL("[router] unknown --moe-router-load-balancing-type '{}': use aux_loss, seq_aux_loss, "
           "global_aux_loss, sinkhorn, quantile_balancing or none",
           s);
}

DispatcherType parse_dispatcher_type(const std::string& s) {
  if (s == "alltoall") return DispatcherType::AlltoAll;
  if (s == "allgather") return DispatcherType::AllGather;
  MOE_CHECK(s != "flex",
            "[dispatcher] --moe-token-dispatcher-type flex (DeepEP/HybridEP fused dispatch) is not "
            "implemented yet: use alltoall (same model) or allgather");
  MOE_FAIL("[dispatcher] unknown --moe-token-dispatcher-type '{}': use alltoall or allgather", s);
}

}  // namespace

void add_router_flags(CLI::App& app, MoeConfig& moe, RouterFlags& f) {
  RouterConfig& cfg = moe.router;
  const char* kMoe = "Mixture of experts";
  // Validated in finalize_router_flags, so that `flex` gets its own message.
  app.add_option("--moe-token-dispatcher-type", f.token_dispatcher_type,
                 "How tokens reach experts on other EP ranks: alltoall | allgather "
                 "(identical on one EP rank)")
      ->group(kMoe);
  app.add_option("--moe-router-topk", cfg.topk, "Experts per token")->group(kMoe);
  app.add_option("--moe-router-score-function", f.score_function,
                 "softmax | sigmoid | sqrtsoftplus")
      ->check(CLI::IsMember({"softmax", "sigmoid", "sqrtsoftplus"}))
      ->group(kMoe);
  app.add_flag("--moe-router-pre-softmax", cfg.pre_softmax, "Softmax before top-k")->group(kMoe);
  app.add_option("--moe-router-topk-scaling-factor", cfg.topk_scaling_factor,
                 "Scale the routing probs")
      ->group(kMoe);
  app.add_option("--moe-router-load-balancing-type", f.load_balancing,
                 "One or more of aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, "
                 "quantile_balancing, none")
      ->check(CLI::IsMember({"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                             "quantile_balancing", "none"}))
      ->group(kMoe);
  app.add_option("--moe-aux-loss-coeff", f.aux_loss_coeff,
                 "Aux loss coefficient; one per --moe-router-load-balancing-type entry")
      ->default_str("0.0")
      ->group(kMoe);
  app.add_option("--moe-z-loss-coeff", cfg.z_loss_coeff, "Z-loss coefficient")->group(kMoe);
  app.add_option("--moe-router-dtype", f.router_dtype, "Router gate precision: fp32 | fp64 (None: fp32, also with --bf16)")
      ->check(CLI::IsMember({"fp32", "fp64"}))
      ->group(kMoe);
  app.add_option("--moe-input-jitter-eps", cfg.input_jitter_eps,
                 "Multiply router inputs by U(1-eps, 1+eps) in training")
      ->group(kMoe);
  app.add_option("--moe-router-num-groups", cfg.num_groups,
                 "Expert groups for group-limited routing (device/node-limited)")
      ->group(kMoe);
  app.add_option("--moe-router-group-topk", cfg.group_topk, "Groups each token may use")
      ->group(kMoe);
  app.add_flag("--moe-router-enable-expert-bias", cfg.enable_expert_bias,
               "Aux-loss-free balancing with a per-expert selection bias")
      ->group(kMoe);
  app.add_option("--moe-router-bias-update-rate", cfg.bias_update_rate,
                 "Expert-bias step per iteration")
      ->group(kMoe);
  app.add_option("--moe-router-quantile-balancing-ema", cfg.quantile_ema,
                 "EMA factor of quantile balancing's beta")
      ->group(kMoe);
  app.add_option("--moe-expert-capacity-factor", cfg.capacity_factor,
                 "Expert capacity = ceil(T*K/E * factor); absent or <= 0: dropless")
      ->group(kMoe);
  app.add_option("--moe-token-drop-policy", f.token_drop_policy,
                 "Which tokens an over-full expert keeps: probs | position")
      ->check(CLI::IsMember({"probs", "position"}))
      ->group(kMoe);
  app.add_flag("--moe-pad-expert-input-to-capacity", cfg.pad_to_capacity,
               "Every expert processes exactly capacity rows")
      ->group(kMoe);
  app.add_option("--moe-expert-rank-capacity-factor", moe.expert_rank_capacity_factor,
                 "Under EP, plan each EP rank's received rows for factor x the balanced load "
                 "(T*K) instead of the dropless worst case EP*T*K; a step over it stops with an "
                 "error (>= 1; absent: the worst case)")
      ->group(kMoe);
  app.add_flag("--moe-aux-loss-megatron-map", cfg.megatron_aux_map,
               "Aux-loss counts from the plain top-k, ignoring group limits and expert bias "
               "(Megatron's behaviour, issue #2767; default: the experts tokens really chose)")
      ->group(kMoe);
}

void finalize_router_flags(MoeConfig& moe, const RouterFlags& f) {
  moe.dispatcher_type = parse_dispatcher_type(f.token_dispatcher_type);
  RouterConfig& cfg = moe.router;
  cfg.score = f.score_function == "sigmoid"        ? ScoreFunction::Sigmoid
              : f.score_function == "sqrtsoftplus" ? ScoreFunction::SqrtSoftplus
                                                   : ScoreFunction::Softmax;
  cfg.dtype = f.router_dtype == "fp64" ? RouterDType::F64 : RouterDType::F32;
  cfg.drop_policy =
      f.token_drop_policy == "position" ? TokenDropPolicy::Position : TokenDropPolicy::Probs;

  MOE_CHECK(!f.load_balancing.empty(), "[router] --moe-router-load-balancing-type needs a value");
  std::vector<double> coeffs = f.aux_loss_coeff;
  if (coeffs.empty() && f.load_balancing.size() == 1) coeffs = {cfg.aux_loss_coeff};
  MOE_CHECK(coeffs.size() == f.load_balancing.size(),
            "[router] {} load-balancing types but {} --moe-aux-loss-coeff values: give one "
            "coefficient per type, in the same order (e.g. --moe-router-load-balancing-type "
            "aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-3 1e-4)",
            f.load_balancing.size(), coeffs.size());
  cfg.load_balancing = parse_load_balancing(f.load_balancing[0]);
  cfg.aux_loss_coeff = coeffs[0];
  cfg.extra_load_balancing.clear();
  for (size_t i = 1; i < f.load_balancing.size(); ++i) {
    cfg.extra_load_balancing.push_back({parse_load_balancing(f.load_balancing[i]), coeffs[i]});
  }
  // Megatron: a negative capacity factor means "no capacity" (dropless).
  if (cfg.capacity_factor < 0) cfg.capacity_factor = 0;
  // RouterConfig::validate runs from ModelConfig::validate once num_experts is known.
}

}  // namespace moecore::cli
