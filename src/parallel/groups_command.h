// `moecore groups --world-size N <layout flags> [--json]`: prints every process group of a
// layout without launching anything, so a layout can be checked before paying for it.
#pragma once

#include <iosfwd>

#include "core/command.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

Subcommand add_groups_command(CLI::App& app);

// The JSON object of `moecore groups --json`: one key per group name ("tp", ..., "tp_ep_pp"),
// each a list of rank lists.
std::string layout_json(const Layout& layout);
// The human-readable listing; with rank >= 0 also that rank's groups and positions.
void print_layout(std::ostream& os, const Layout& layout, int rank);

}  // namespace moecore::parallel
