// The table of every flag Megatron-LM's megatron/training/arguments.py defines, read from its
// own argparse parser by tools/megatron_flags.py (src/cli/megatron_arguments.json, embedded at
// build time): names and aliases, dest, action, type, nargs, choices, default and argument
// group, with the Megatron-LM commit it came from. The facts `moecore train` parses against.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moecore::cli {

enum class ArgAction { Store, StoreTrue, StoreFalse, BooleanOptional };
enum class ArgType { None, Int, Float, Str, Bool, Other };  // Other: a Megatron parse function

struct MegatronFlag {
  std::vector<std::string> names;  // every spelling, with the leading "--"
  std::string dest;
  ArgAction action = ArgAction::Store;
  ArgType type = ArgType::None;
  std::string type_name;           // "int", ..., or the parse function's name
  std::string nargs;               // "" (one value), "?", "*", "+" or a count
  std::vector<std::string> choices;  // as text; empty: any value of the type
  nlohmann::json default_value;    // null for None
  std::string group;               // arguments.py's argument group title
  std::string help;

  const std::string& name() const { return names.front(); }
  bool takes_values() const { return action == ArgAction::Store; }
};

struct MegatronArguments {
  std::string source;  // repository and file
  std::string commit;  // the Megatron-LM commit the table was read from
  std::vector<MegatronFlag> flags;

  // The flag spelled `name` (with "--"), or null.
  const MegatronFlag* find(const std::string& name) const;
  // Megatron's spelling closest to `name` (edit distance), for "did you mean" messages.
  std::string nearest(const std::string& name) const;
};

const MegatronArguments& megatron_arguments();

// Megatron's default as command-line text ("" for None; lists space-separated; store_true
// False -> "false").
std::string default_text(const MegatronFlag& f);

}  // namespace moecore::cli
