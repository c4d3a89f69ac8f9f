// `moecore checkpoint info DIR` prints a checkpoint's iteration, layout, run state and tensors;
// `moecore checkpoint compare A B` says whether two checkpoints hold the same global tensors,
// byte for byte, whatever layouts wrote them (exit status 0: equal, 1: they differ, each
// difference named on its own line; 2: one could not be read). DIR is a --save directory (its
// latest checkpoint) or an iter_NNNNNNN directory. Every shard's size and SHA-256 are checked
// first. `moecore checkpoint recover DIR` does to a --save directory what a run's startup does
// after a crash in a save (recover_checkpoint_dir) and says what it did.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "core/command.h"

namespace moecore::ckpt {

Subcommand add_checkpoint_command(CLI::App& app);

// The differences between the global tensors of two checkpoints (names in one only, dtype or
// shape, bytes): one line each, empty when they are equal. `skip_prefixes`: tensors to leave
// out (e.g. "exp_avg" to compare the weights only).
std::vector<std::string> compare_checkpoints(const std::filesystem::path& a,
                                             const std::filesystem::path& b,
                                             const std::vector<std::string>& skip_prefixes = {});
// An iteration directory: `dir` itself when it holds a manifest, else the one its tracker names
// (find_iteration_dir).
std::filesystem::path resolve_checkpoint(const std::filesystem::path& dir);

}  // namespace moecore::ckpt
