// `--config FILE`: a TOML file whose keys are `moecore train` flag names (dashes or underscores,
// without the leading `--`). Its values become command-line arguments placed before the real
// ones, so flags given on the command line override the file.
#pragma once

#include <string>
#include <vector>

namespace moecore::cli {

// Arguments for the TOML file at `path`: `key = 3` -> "--key" "3"; `flag = true` -> "--flag"
// (false: nothing); arrays -> "--key" v1 v2 ...
std::vector<std::string> config_file_args(const std::string& path);
// The same for TOML text in memory (a flags file about to be written); `where` names it in
// messages.
std::vector<std::string> config_text_args(const std::string& text, const std::string& where);

// args (without the program name; args[0] is the subcommand): every "--config FILE" or
// "--config=FILE" is replaced by the file's arguments, inserted right after the subcommand.
std::vector<std::string> expand_config_files(const std::vector<std::string>& args);

}  // namespace moecore::cli
