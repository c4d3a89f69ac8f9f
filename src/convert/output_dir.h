// The --output of `moecore convert`: checked before any work, so a conversion never overwrites
// a checkpoint, never mixes an HF and a moecore checkpoint in one directory, and does not fail at
// its last step for a path it cannot create or write; created only once there is a result.
#pragma once

#include <filesystem>
#include <string>

namespace moecore::convert {

// Throws naming `out` and the fix unless it is absent and can be created (its nearest existing
// ancestor a writable directory), or an existing directory that holds neither an HF checkpoint
// (config.json, *.safetensors, the index) nor a moecore one (latest_checkpointed_iteration.txt,
// iter_*, manifest.json). Changes nothing on disk. `what` names the output ("an HF checkpoint").
void check_output_dir(const std::filesystem::path& out, const std::string& what);

// Creates `out` (check_output_dir first, before any work) and proves it writable with a probe
// file (removed): called once the conversion is done and about to be written, so a refused
// conversion leaves nothing behind.
void create_output_dir(const std::filesystem::path& out);

}  // namespace moecore::convert
