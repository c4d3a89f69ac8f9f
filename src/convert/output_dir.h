// The --output of `moecore convert`: checked before any work, so a conversion never overwrites
// a checkpoint, never mixes an HF and a moecore checkpoint in one directory, and does not fail at
// its last step for a path it cannot create or write; created only once there is a result. An
// export is staged beside it and published whole (StagedOutput).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace moecore::convert {

// Throws naming `out` and the fix unless it is absent and can be created (its nearest existing
// ancestor a writable directory), or an existing directory that holds neither an HF checkpoint
// (config.json, *.safetensors, the index) nor a moecore one (latest_checkpointed_iteration.txt,
// iter_*, manifest.json); with `empty` (an output published whole, StagedOutput) an existing
// directory must hold nothing at all. Changes nothing on disk. `what` names the output ("an HF
// checkpoint").
void check_output_dir(const std::filesystem::path& out, const std::string& what,
                      bool empty = false);

// Creates `out` (check_output_dir first, before any work) and proves it writable with a probe
// file (removed): called once the conversion is done and about to be written, so a refused
// conversion leaves nothing behind.
void create_output_dir(const std::filesystem::path& out);

// An output written whole or not at all: its files go into a staging directory beside `out`
// (`.<name>.partial` in the same parent, so the rename never crosses a file system), and once
// every file is written and flushed, publish() renames it onto `out` in one step (rename(2)
// replaces an absent path or an empty directory, which check_output_dir(out, what, true) has
// required). Until then `out` is untouched: an error unwinds through the destructor, which
// removes the staging directory; a process killed meanwhile leaves only the staging directory,
// which the next StagedOutput of the same `out` removes before it starts.
class StagedOutput {
 public:
  explicit StagedOutput(const std::filesystem::path& out);
  ~StagedOutput();
  StagedOutput(const StagedOutput&) = delete;
  StagedOutput& operator=(const StagedOutput&) = delete;

  const std::filesystem::path& dir() const { return staging_; }  // where the files go
  void publish();

  // `.<name>.partial` beside `out`.
  static std::filesystem::path staging_path(const std::filesystem::path& out);

 private:
  std::filesystem::path out_, staging_;
  bool published_ = false;
};

// The failure points of a conversion's writes, for the robustness tests (core/fault_injection.h):
// MOECORE_FAULT="kill:at=<point>" kills the process there, "convert_error:at=<point>" throws the
// error a failed write would. Points: export.after_config, export.after_shard (each weights
// file), export.after_weights, export.before_publish.
void convert_fault_point(std::string_view point);

}  // namespace moecore::convert
