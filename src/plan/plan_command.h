// `moecore plan <model flags | --config FILE | --hf-config config.json> <layout flags> [batch,
// precision, recompute flags] [--hardware NAME ...] [--json] [--search --gpus N]`: parameters,
// memory per rank, communication, FLOPs and a roofline step time for a layout, or the layouts
// of a world size that fit, ranked (docs/plan.md).
#pragma once

#include <string>
#include <vector>

#include "core/command.h"

namespace moecore::plan {

Subcommand add_plan_command(CLI::App& app);
// The command without the subcommand name (what the tests call); returns the exit code.
int run_plan(const std::vector<std::string>& args, std::string& out);

}  // namespace moecore::plan
