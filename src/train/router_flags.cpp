#include "train/router_flags.h"

namespace moecore::train {

void add_router_flags(CLI::App& app, RouterConfig& cfg, RouterFlags& f) {
  const char* kMoe = "Mixture of experts";
  app.add_option("--moe-router-topk", cfg.topk, "Experts per token")->group(kMoe);
  app.add_option("--moe-router-score-function", f.score_function, "softmax | sigmoid")
      ->check(CLI::IsMember({"softmax", "sigmoid"}))
      ->group(kMoe);
  app.add_flag("--moe-router-pre-softmax", cfg.pre_softmax, "Softmax before top-k")->group(kMoe);
  app.add_option("--moe-router-topk-scaling-factor", cfg.topk_scaling_factor,
                 "Scale the routing probs")
      ->group(kMoe);
  app.add_option("--moe-router-load-balancing-type", f.load_balancing, "aux_loss | none")
      ->check(CLI::IsMember({"aux_loss", "none"}))
      ->group(kMoe);
  app.add_option("--moe-aux-loss-coeff", cfg.aux_loss_coeff, "Aux loss coefficient")->group(kMoe);
  app.add_option("--moe-z-loss-coeff", cfg.z_loss_coeff, "Z-loss coefficient")->group(kMoe);
}

void finalize_router_flags(RouterConfig& cfg, const RouterFlags& f) {
  cfg.score = f.score_function == "sigmoid" ? ScoreFunction::Sigmoid : ScoreFunction::Softmax;
  cfg.load_balancing = f.load_balancing == "none" ? LoadBalancing::None : LoadBalancing::AuxLoss;
}

}  // namespace moecore::train
