// `moecore convert hf-to-moecore`: a HuggingFace checkpoint (config.json and safetensors
// weights) into a moecore checkpoint at iteration 0, written as the trainer writes one
// (docs/checkpoint_format.md), plus moecore_flags.toml, the `moecore train` flags of the model.
// Every HF tensor must be consumed and every moecore parameter filled, or nothing is written and
// the error names what is left over or missing.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "convert/hf_config.h"

namespace moecore::convert {

inline constexpr std::string_view kFlagsFile = "moecore_flags.toml";

struct ImportResult {
  HfModelSpec spec;
  std::vector<std::string> warnings;  // settings not converted (training only)
  int64_t hf_tensors = 0;             // read from the HF files
  int64_t moecore_tensors = 0;        // written
  int64_t parameters = 0;             // elements of the moecore model
  std::filesystem::path checkpoint;   // <out>/iter_0000000
  std::filesystem::path flags_file;   // <out>/moecore_flags.toml
};

// Converts `hf_dir` into `out_dir` (created; refused when it holds a checkpoint already).
ImportResult import_hf(const std::filesystem::path& hf_dir, const std::filesystem::path& out_dir);

}  // namespace moecore::convert
