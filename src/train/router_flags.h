// Megatron-LM's router flags (--moe-router-*, load balancing, aux/z losses) bound to
// RouterConfig. String-valued flags are kept in RouterFlags and resolved after parsing.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "model/config.h"

namespace moecore::train {

struct RouterFlags {
  std::string score_function = "softmax";
  std::string load_balancing = "aux_loss";
};

void add_router_flags(CLI::App& app, RouterConfig& cfg, RouterFlags& f);
void finalize_router_flags(RouterConfig& cfg, const RouterFlags& f);

}  // namespace moecore::train
