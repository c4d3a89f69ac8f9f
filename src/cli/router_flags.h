// Megatron-LM's router flags (--moe-router-*, load balancing, aux/z losses, capacity) bound to
// RouterConfig, and --moe-token-dispatcher-type bound to MoeConfig. String- and list-valued
// flags are kept in RouterFlags and resolved after parsing. Modes: docs/router.md; dispatchers:
// docs/parallel.md.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"

namespace CLI {
class App;  // <CLI/CLI.hpp> (heavy) in the .cpp files that build parsers
}  // namespace CLI

namespace moecore::cli {

struct RouterFlags {
  std::string score_function = "softmax";
  std::vector<std::string> load_balancing = {"aux_loss"};  // one entry per type
  std::vector<double> aux_loss_coeff;  // empty: RouterConfig::aux_loss_coeff for one type
  std::string router_dtype;  // None (Megatron: the params dtype): fp32, as invariant 5 says
  std::string token_drop_policy = "probs";
  std::string token_dispatcher_type = "allgather";  // Megatron's default; alltoall: same model
};

// The router flags fill cfg.router; --moe-token-dispatcher-type fills cfg.dispatcher_type.
void add_router_flags(CLI::App& app, MoeConfig& cfg, RouterFlags& f);
void finalize_router_flags(MoeConfig& cfg, const RouterFlags& f);

}  // namespace moecore::cli
