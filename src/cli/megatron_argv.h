// argparse's semantics for `moecore train`, driven by Megatron-LM's flag table: `--flag value`
// and `--flag=value`, nargs and types and choices checked as Megatron's parser checks them, no
// abbreviations (Megatron builds its parser with allow_abbrev=False), and the last occurrence of
// a dest wins (lists too; a store_true / store_false pair shares its dest). A flag neither
// Megatron nor moecore defines is an error naming the nearest Megatron flag.
#pragma once

#include <string>
#include <vector>

#include "cli/megatron_arguments.h"

namespace moecore::cli {

// A flag moecore has and Megatron lacks (--config, --metrics-file, ...).
struct OwnFlag {
  std::string name;  // with "--"
  int min_values = 0, max_values = 0;  // max < 0: unbounded
};

// One dest as the command line leaves it: its last occurrence.
struct GivenFlag {
  std::string name;                 // the spelling used
  const MegatronFlag* megatron = nullptr;  // null for moecore's own flags
  std::vector<std::string> values;  // empty for store_true / store_false / on-off flags
  // The resulting value as text: the values space-separated; "true" / "false" for switches.
  std::string value_text() const;
};

struct ParsedArgs {
  std::vector<GivenFlag> flags;  // in the order of their last occurrences
  bool help = false;             // -h or --help

  const GivenFlag* find_dest(const std::string& dest) const;
  // Arguments for CLI11: the flags `keep` selects, each once, values attached.
  template <typename Pred>
  std::vector<std::string> args_for(Pred keep) const {
    std::vector<std::string> out;
    for (const GivenFlag& g : flags) {
      if (!keep(g)) continue;
      if (g.values.size() == 1) {
        out.push_back(g.name + "=" + g.values[0]);  // "=": a value like -1 stays a value
      } else {
        out.push_back(g.name);
        out.insert(out.end(), g.values.begin(), g.values.end());
      }
    }
    return out;
  }
};

// `extra_choices`: values moecore accepts beyond Megatron's choices, as "--flag=value" entries.
ParsedArgs parse_megatron_argv(const std::vector<std::string>& args,
                               const std::vector<OwnFlag>& own,
                               const std::vector<std::string>& extra_choices = {});

}  // namespace moecore::cli
